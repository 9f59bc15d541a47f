"""Loaders: every reader on real files, column mapping, validation, the load/generate
commands against a real server, query files and results written to files."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from geonear.clients.cli import main
from geonear.clients.client import Client
from geonear.geometry import great_circle_m
from geonear.loaders import (
    BUNDLED,
    DATA_SETS,
    ColumnError,
    EmptyInput,
    InvalidPoints,
    decode_wkb_points,
    detect_columns,
    generate_points,
    load_bundled,
    open_points,
    read_points,
    read_query_points,
    upload_points,
    write_points,
    write_table,
)
from geonear.loaders.csv_files import sniff_csv
from geonear.service.server import create_server
from geonear.service.settings import ServerSettings

PYTHON = sys.executable
ROOT = Path(__file__).resolve().parents[1]


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    data_dir = tmp_path_factory.mktemp("server-data")
    srv, port, _ = create_server(
        ServerSettings(host="127.0.0.1", port=0, data_dir=data_dir, backend="cpu")
    )
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(grace=None)


@pytest.fixture
def client(server: str):
    with Client(server) as c:
        yield c


def _table(reader: pa.RecordBatchReader) -> pd.DataFrame:
    return reader.read_all().to_pandas()


def _wkb_point(x: float, y: float, big_endian: bool = False, srid: int | None = None) -> bytes:
    order = ">" if big_endian else "<"
    if srid is None:
        return struct.pack(f"{order}BIdd", 0 if big_endian else 1, 1, x, y)
    return struct.pack(f"{order}BIIdd", 0 if big_endian else 1, 0x20000001, srid, x, y)


def _geoparquet(
    path: Path, table: pa.Table, column: str, encoding: str, crs: object = None
) -> None:
    info: dict[str, object] = {"encoding": encoding, "geometry_types": ["Point"]}
    if crs is not None:
        info["crs"] = crs
    meta = {"version": "1.1.0", "primary_column": column, "columns": {column: info}}
    pq.write_table(table.replace_schema_metadata({b"geo": json.dumps(meta).encode()}), path)


# -- CSV -----------------------------------------------------------------------------------
def test_csv_with_header_detects_spelled_out_columns(tmp_path: Path) -> None:
    path = tmp_path / "stations.csv"
    path.write_text("code,Latitude,lng,elevation\nA1,48.85,2.35,35\nB2,-33.87,151.21,3\n")
    stream = open_points(path)
    frame = _table(stream.reader)
    assert stream.mapping.lat == "Latitude" and stream.mapping.lon == "lng"
    assert stream.mapping.id == "code"
    assert frame.columns.tolist() == ["id", "lat", "lon", "elevation"]
    assert frame["id"].tolist() == ["A1", "B2"]
    assert frame["lat"].tolist() == [48.85, -33.87]
    assert frame["elevation"].tolist() == [35, 3]


@pytest.mark.parametrize("delimiter", [";", "\t", "|"])
def test_csv_delimiter_is_detected(tmp_path: Path, delimiter: str) -> None:
    path = tmp_path / "points.txt"
    rows = ["id,lat,lon,label", "1,10.5,20.25,first, with comma", "2,-1,3,second"]
    # Values may contain commas when another delimiter is used.
    path.write_text("\n".join(r.replace(",", delimiter, 3) for r in rows) + "\n")
    frame = _table(read_points(path))
    assert frame["lon"].tolist() == [20.25, 3.0]
    assert frame["label"].tolist() == ["first, with comma", "second"]


def test_csv_without_header_gets_numbered_columns(tmp_path: Path) -> None:
    path = tmp_path / "raw.csv"
    path.write_text("7,45.0,7.5\n8,46.0,8.5\n")
    assert sniff_csv(path.read_text())[:2] == (",", False)
    with pytest.raises(ColumnError, match=r"columns found: f0, f1, f2"):
        read_points(path)
    frame = _table(read_points(path, lat="f1", lon="f2", id="f0"))
    assert frame["id"].tolist() == [7, 8]
    assert frame["lat"].tolist() == [45.0, 46.0]


def test_csv_compressed_with_gzip(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "points.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("lat,lon\n1,2\n3,4\n")
    frame = _table(read_points(path))
    assert frame["lat"].tolist() == [1.0, 3.0]
    assert frame["id"].tolist() == [0, 1]


def test_csv_non_numeric_coordinates_are_reported_by_row(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    lines = ["id,lat,lon"] + [f"{i},{i % 80},{i % 170}" for i in range(1000)]
    lines[101] = "100,north,5"  # row 100: not a number
    lines[501] = "500,,5"  # row 500: missing
    lines[801] = "800,91.5,5"  # row 800: out of range
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InvalidPoints) as info:
        read_points(path, batch_rows=128).read_all()
    message = str(info.value)
    assert "3 of 1,000 rows are invalid" in message
    assert "row 100: lat='north'" in message and "not a number" in message
    assert "row 500" in message and "missing" in message
    assert "row 800: lat='91.5'" in message and "out of range" in message
    assert info.value.report.bad_rows == 3
    stream = open_points(path, skip_invalid=True, batch_rows=128)
    table = stream.reader.read_all()
    assert table.num_rows == 997
    assert stream.report.rows_dropped == 3
    assert 100 not in table.column("id").to_pylist()


def test_csv_on_standard_input_loads_through_the_cli(server: str, client: Client) -> None:
    csv_text = "name,lat,lon\nParis,48.8566,2.3522\nTokyo,35.6762,139.6503\n"
    run = subprocess.run(
        [PYTHON, "-m", "geonear", "load", "-", "--name", "stdin_points", "--target", server],
        input=csv_text,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "loaded 2 rows into stdin_points" in run.stdout
    # Output is not a terminal: no progress bar is drawn.
    assert "rows/s" not in run.stderr
    near = client.knn("stdin_points", [48.0], [2.0], k=1)
    assert near["id"].tolist() == ["Paris"]


# -- Parquet, Arrow, datasets -----------------------------------------------------------
def _points_table(n: int = 50, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "id": np.arange(n, dtype=np.int64),
            "latitude": rng.uniform(-60, 60, n),
            "longitude": rng.uniform(-170, 170, n),
            "kind": ["a", "b"] * (n // 2),
        }
    )


def test_parquet_feather_and_arrow_stream_read_alike(tmp_path: Path) -> None:
    table = _points_table()
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=7)
    feather.write_feather(table, tmp_path / "p.feather")
    with (
        pa.OSFile(str(tmp_path / "p.arrows"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table, max_chunksize=11)
    frames = []
    for name in ("p.parquet", "p.feather", "p.arrows"):
        stream = open_points(tmp_path / name, batch_rows=16)
        batches = list(stream.reader)
        assert max(b.num_rows for b in batches) <= 16
        frames.append(pa.Table.from_batches(batches).to_pandas())
    assert stream.source.description.startswith("Arrow IPC stream")
    for frame in frames:
        assert frame["lat"].tolist() == table.column("latitude").to_pylist()
        assert frame["kind"].tolist() == table.column("kind").to_pylist()


def test_glob_and_directory_read_every_file(tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    for i in range(3):
        t = _points_table(10, seed=i)
        t = t.set_column(0, "id", pa.array(np.arange(10) + 10 * i))
        pq.write_table(t, parts / f"part-{i}.parquet")
    from_dir = read_points(parts).read_all()
    from_glob = read_points(str(parts / "part-*.parquet")).read_all()
    assert from_dir.num_rows == from_glob.num_rows == 30
    assert sorted(from_glob.column("id").to_pylist()) == list(range(30))
    csv_dir = tmp_path / "csvs"
    csv_dir.mkdir()
    (csv_dir / "a.csv").write_text("lat;lon\n1;2\n")
    (csv_dir / "b.csv").write_text("lat;lon\n3;4\n5;6\n")
    assert read_points(str(csv_dir / "*.csv")).read_all().num_rows == 3
    with pytest.raises(FileNotFoundError, match="no files match"):
        read_points(str(tmp_path / "nothing-*.parquet"))


def test_in_memory_objects_read_alike() -> None:
    table = _points_table(20)
    frame = table.to_pandas()
    reader = table.to_reader(max_chunksize=6)
    dataset = ds.dataset(table)
    for source in (frame, table, reader, dataset, table.to_batches()[0]):
        out = read_points(source).read_all()
        assert out.column("id").to_pylist() == list(range(20)), type(source)
        assert out.column("lon").to_pylist() == table.column("longitude").to_pylist()
    indexed = frame.set_index("id")
    assert read_points(indexed).read_all().column("id").to_pylist() == list(range(20))


# -- GeoJSON -------------------------------------------------------------------------------
def test_geojson_points_with_properties_as_columns(tmp_path: Path) -> None:
    collection = {
        "type": "FeatureCollection",
        "name": "stops",
        "features": [
            {
                "type": "Feature",
                "id": "s1",
                "geometry": {"type": "Point", "coordinates": [2.35, 48.85]},
                "properties": {"name": "Paris", "riders": 10},
            },
            {
                "type": "Feature",
                "id": "s2",
                "geometry": {"type": "Point", "coordinates": [-0.12, 51.5, 11.0]},
                "properties": {"name": "London", "riders": 7.5},
            },
        ],
        "crs": {"type": "name", "properties": {"name": "urn:ogc:def:crs:OGC:1.3:CRS84"}},
    }
    path = tmp_path / "stops.geojson"
    path.write_text(json.dumps(collection, indent=1))
    stream = open_points(path)
    frame = _table(stream.reader)
    assert stream.source.geometry == ("lat", "lon")
    assert frame["id"].tolist() == ["s1", "s2"]
    assert frame["lat"].tolist() == [48.85, 51.5]
    assert frame["lon"].tolist() == [2.35, -0.12]
    assert frame["riders"].tolist() == [10, 7.5]
    assert "name" in frame.columns


def test_geojson_streams_many_features_and_sequences(tmp_path: Path) -> None:
    features = [
        {
            "type": "Feature",
            "geometry": {"type": "Point", "coordinates": [i / 100, 0]},
            "properties": {"n": i},
        }
        for i in range(5000)
    ]
    path = tmp_path / "many.geojson"
    path.write_text(json.dumps({"type": "FeatureCollection", "features": features}))
    batches = list(read_points(path, batch_rows=1000))
    assert len(batches) == 5
    table = pa.Table.from_batches(batches)
    assert table.column("n").to_pylist() == list(range(5000))
    assert table.column("id").to_pylist() == list(range(5000))
    seq = tmp_path / "seq.geojsonl"
    seq.write_text("\n".join("\x1e" + json.dumps(f) for f in features[:3]) + "\n")
    assert read_points(seq).read_all().column("n").to_pylist() == [0, 1, 2]


def test_geojson_rejects_non_point_features(tmp_path: Path) -> None:
    path = tmp_path / "line.geojson"
    path.write_text(
        json.dumps(
            {
                "type": "FeatureCollection",
                "features": [
                    {
                        "type": "Feature",
                        "geometry": {"type": "Point", "coordinates": [0, 0]},
                        "properties": {},
                    },
                    {
                        "type": "Feature",
                        "geometry": {"type": "LineString", "coordinates": [[0, 0], [1, 1]]},
                        "properties": {},
                    },
                ],
            }
        )
    )
    with pytest.raises(ValueError, match="feature 1 has a LineString geometry"):
        read_points(path).read_all()


# -- GeoParquet ----------------------------------------------------------------------------
def test_geoparquet_wkb_points_little_big_endian_and_ewkb(tmp_path: Path) -> None:
    wkb = [
        _wkb_point(2.35, 48.85),
        _wkb_point(-0.12, 51.5, big_endian=True),
        _wkb_point(139.65, 35.68, srid=4326),
        None,
    ]
    table = pa.table(
        {"station": ["paris", "london", "tokyo", "nowhere"], "geometry": pa.array(wkb, pa.binary())}
    )
    path = tmp_path / "stations.parquet"
    _geoparquet(path, table, "geometry", "WKB", crs={"id": {"authority": "EPSG", "code": 4326}})
    stream = open_points(path, id="station", skip_invalid=True)
    frame = _table(stream.reader)
    assert frame["id"].tolist() == ["paris", "london", "tokyo"]
    assert frame["lat"].tolist() == [48.85, 51.5, 35.68]
    assert frame["lon"].tolist() == [2.35, -0.12, 139.65]
    assert "geometry" not in frame.columns
    # The null geometry is a row without coordinates: reported, here dropped.
    assert stream.report.rows_dropped == 1


def test_geoparquet_geoarrow_point_struct(tmp_path: Path) -> None:
    points = pa.StructArray.from_arrays(
        [pa.array([10.0, 20.0]), pa.array([-5.0, 5.0])], names=["x", "y"]
    )
    path = tmp_path / "geoarrow.parquet"
    _geoparquet(path, pa.table({"id": [1, 2], "geom": points}), "geom", "point")
    frame = _table(read_points(path))
    assert frame["lon"].tolist() == [10.0, 20.0]
    assert frame["lat"].tolist() == [-5.0, 5.0]


def test_geoparquet_rejects_polygons_and_projected_crs(tmp_path: Path) -> None:
    polygon = (
        struct.pack("<BII", 1, 3, 1)
        + struct.pack("<I", 4)
        + struct.pack("<8d", 0, 0, 1, 0, 1, 1, 0, 0)
    )
    with pytest.raises(ValueError, match=r"1 geometries are not points \(first: row 1: Polygon"):
        decode_wkb_points(pa.array([_wkb_point(0, 0), polygon], pa.binary()))
    path = tmp_path / "projected.parquet"
    _geoparquet(
        path,
        pa.table({"geometry": pa.array([_wkb_point(500000, 4e6)], pa.binary())}),
        "geometry",
        "WKB",
        crs={"name": "WGS 84 / UTM zone 33N", "id": {"authority": "EPSG", "code": 32633}},
    )
    with pytest.raises(ValueError, match=r"UTM zone 33N.*reproject"):
        read_points(path)


def test_geopandas_points() -> None:
    geopandas = pytest.importorskip("geopandas")
    shapely = pytest.importorskip("shapely")
    frame = geopandas.GeoDataFrame(
        {"id": [5, 6], "v": ["a", "b"]},
        geometry=[shapely.Point(1, 2), shapely.Point(3, 4)],
        crs=4326,
    )
    out = _table(read_points(frame))
    assert out[["id", "lat", "lon", "v"]].values.tolist() == [
        [5, 2.0, 1.0, "a"],
        [6, 4.0, 3.0, "b"],
    ]
    with pytest.raises(ValueError, match="to_crs"):
        read_points(frame.to_crs(3857))


# -- column mapping ------------------------------------------------------------------------
def test_detect_columns_rules() -> None:
    m = detect_columns(["Y", "X", "code"])
    assert (m.lat, m.lon, m.id) == ("Y", "X", "code")
    m = detect_columns(["id", "name", "lat", "latitude", "lon"])
    assert (m.lat, m.id) == ("lat", "id")  # the canonical name wins
    with pytest.raises(ColumnError, match=r"ambiguous lat column: candidates 'latitude', 'y'"):
        detect_columns(["latitude", "y", "lon"])
    with pytest.raises(ColumnError, match=r"no lon column found.*columns found: lat, height"):
        detect_columns(["lat", "height"])
    with pytest.raises(ColumnError, match=r"ambiguous id column: candidates 'name', 'code'"):
        detect_columns(["lat", "lon", "name", "code"])
    m = detect_columns(["lat", "lon", "name", "code"], id=False)
    assert m.ids_are_row_numbers
    m = detect_columns(["lat", "lon", "wgs_lat", "wgs_lon"], lat="WGS_LAT", lon="wgs_lon")
    assert (m.lat, m.lon) == ("wgs_lat", "wgs_lon")
    assert m.renamed == {"lat": "lat_original", "lon": "lon_original"}
    with pytest.raises(ColumnError, match="no lat column 'latt'"):
        detect_columns(["lat", "lon"], lat="latt")


def test_row_numbers_become_ids_and_the_result_says_so() -> None:
    stream = open_points(
        pd.DataFrame({"lat": [1.0, 2.0, 3.0], "lon": [0.0, 0.0, 0.0]}), batch_rows=2
    )
    table = stream.reader.read_all()
    assert table.column("id").to_pylist() == [0, 1, 2]
    assert stream.ids_are_row_numbers
    assert table.schema.metadata[b"geonear.ids"] == b"row numbers"
    assert "id <- row numbers" in stream.mapping.describe()


def test_mapped_names_clash_is_renamed_not_lost() -> None:
    frame = pd.DataFrame({"lat": ["n/a"], "lon": ["n/a"], "gps_lat": [1.0], "gps_lon": [2.0]})
    table = read_points(frame, lat="gps_lat", lon="gps_lon").read_all()
    assert table.column_names == ["id", "lat", "lon", "lat_original", "lon_original"]
    assert table.column("lat_original").to_pylist() == ["n/a"]


# -- validation ----------------------------------------------------------------------------
def test_nan_infinite_and_out_of_range_are_counted() -> None:
    lat = np.zeros(100)
    lon = np.zeros(100)
    lat[[3, 40]] = np.nan
    lon[7] = np.inf
    lon[60] = -180.5
    lat[99] = -90.0  # poles and the antimeridian are ordinary points
    lon[98] = 180.0
    frame = pa.table({"id": np.arange(100), "lat": lat, "lon": lon})
    with pytest.raises(InvalidPoints) as info:
        read_points(frame, batch_rows=10).read_all()
    report = info.value.report
    assert report.bad_rows == 4
    assert report.reasons == {"NaN": 2, "infinite": 1, "out of range": 1}
    assert [b.row for b in report.examples] == [3, 7, 40, 60]
    assert "row 7: lat=0.0 lon=inf (lon infinite)" in str(info.value)
    assert "Nothing was stored" in str(info.value)
    stream = open_points(frame, skip_invalid=True, batch_rows=10)
    assert stream.reader.read_all().num_rows == 96
    assert stream.report.rows_dropped == 4
    # pandas marks missing values with NaN, which Arrow reads as null: "missing".
    with pytest.raises(InvalidPoints, match=r"row 3: lat=None lon=0.0 \(lat missing"):
        read_points(frame.to_pandas()).read_all()


def test_duplicate_ids_across_batches_int_and_string() -> None:
    ids = [*range(1000), 5, 999, 5]
    frame = pd.DataFrame({"id": ids, "lat": 0.0, "lon": 0.0})
    with pytest.raises(InvalidPoints, match=r"3 of 1,003 rows are invalid \(3 duplicate id\)"):
        read_points(frame, batch_rows=64).read_all()
    text = frame.assign(id=[f"k{i}" for i in ids])
    with pytest.raises(InvalidPoints) as info:
        read_points(text, batch_rows=64).read_all()
    assert [(b.row, b.id) for b in info.value.report.examples] == [
        (1000, "k5"),
        (1001, "k999"),
        (1002, "k5"),
    ]
    stream = open_points(text, skip_invalid=True, batch_rows=64)
    kept = stream.reader.read_all().column("id").to_pylist()
    assert kept == [f"k{i}" for i in range(1000)]
    assert stream.report.rows_dropped == 3


def test_missing_ids_and_empty_input() -> None:
    frame = pd.DataFrame({"id": ["a", None, "c"], "lat": 0.0, "lon": 0.0})
    with pytest.raises(InvalidPoints, match=r"row 1: id=None \(missing id\)"):
        read_points(frame).read_all()
    with pytest.raises(EmptyInput, match="holds no rows"):
        empty = pd.DataFrame({"lat": pd.Series([], dtype=float), "lon": pd.Series([], dtype=float)})
        read_points(empty).read_all()
    all_bad = pd.DataFrame({"lat": [100.0], "lon": [0.0]})
    with pytest.raises(EmptyInput, match="all 1 rows are invalid"):
        read_points(all_bad, skip_invalid=True).read_all()


def test_non_numeric_column_type_is_a_column_error() -> None:
    frame = pd.DataFrame({"lat": [True], "lon": [0.0]})
    with pytest.raises(ColumnError, match="lat column has type bool"):
        read_points(frame).read_all()


# -- bundled and synthetic ------------------------------------------------------------------
def test_bundled_sets_load_offline() -> None:
    assert set(BUNDLED) == {"airports", "cities"}
    sizes = {}
    for name in DATA_SETS:
        table = read_points(name).read_all()
        sizes[name] = table.num_rows
        assert table.column("lat").null_count == 0
        assert table.column("id").to_pylist()[:1]
    assert sizes["airports"] > 20_000 and sizes["cities"] > 20_000
    assert sizes["cities1000"] > 100_000


def test_synthetic_streams_are_seeded_and_chunk_independent(tmp_path: Path) -> None:
    from geonear.loaders.synthetic import CHUNK_ROWS

    n = CHUNK_ROWS + 10
    a = generate_points(n, clustered=True, seed=3).read_all()
    b = generate_points(n, clustered=True, seed=3).read_all()
    c = generate_points(n, clustered=True, seed=4).read_all()
    assert a.equals(b) and not a.equals(c)
    assert a.column("id").to_pylist()[-1] == n - 1
    lat = a.column("lat").to_numpy()
    assert np.all(np.abs(lat) <= 90)
    u = generate_points(200_000, seed=1).read_all()
    # Uniform on the sphere: half the points within 30 degrees of the equator.
    share = np.mean(np.abs(u.column("lat").to_numpy()) < 30.0)
    assert abs(share - 0.5) < 0.01
    for suffix in ("parquet", "csv", "arrow"):
        out = tmp_path / f"pts.{suffix}"
        assert write_points(out, 1000, clustered=True, seed=2) == 1000
        back = read_points(out).read_all()
        assert back.num_rows == 1000
        np.testing.assert_allclose(
            back.column("lat").to_numpy(),
            generate_points(1000, clustered=True, seed=2).read_all().column("lat").to_numpy(),
            rtol=0,
            atol=1e-12,
        )


def test_loaders_do_not_import_the_service() -> None:
    code = (
        "import sys, geonear.loaders, geonear.loaders.cli; "
        "print(sorted(m for m in sys.modules if m.startswith('geonear.service')))"
    )
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- upload and the command line against a real server ------------------------------------
def test_upload_points_streams_and_reports(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "gen.parquet"
    write_points(path, 50_000, seed=9)
    result = upload_points(client, "streamed", path, batch_rows=8_000)
    assert result.rows_stored == 50_000 and result.dataset.rows == 50_000
    assert client.info("streamed").rows == 50_000
    more = pd.DataFrame({"lat": [1.0, 2.0], "lon": [3.0, 4.0]})
    appended = upload_points(client, "streamed", more, mode="append")
    assert appended.ids_are_row_numbers
    assert appended.dataset.rows == 50_002


def test_a_rejected_upload_stores_nothing(client: Client) -> None:
    good = pd.DataFrame({"id": [1, 2], "lat": [0.0, 1.0], "lon": [0.0, 1.0]})
    upload_points(client, "kept", good)
    lat = np.zeros(20_000)
    lat[-1] = 123.0  # found only in the last batch, after earlier batches were sent
    bad = pd.DataFrame({"id": np.arange(20_000), "lat": lat, "lon": 0.0})
    with pytest.raises(InvalidPoints, match=r"row 19999: lat=123\.0"):
        upload_points(client, "kept", bad, mode="replace", batch_rows=1000)
    assert client.info("kept").rows == 2
    with pytest.raises(InvalidPoints):
        upload_points(client, "never_created", bad, batch_rows=1000)
    assert "never_created" not in {d.name for d in client.datasets()}


def test_cli_generate_then_load(
    server: str, client: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pts.parquet"
    assert main(["generate", "--n", "30000", "--clustered", "--seed", "1", "--out", str(out)]) == 0
    assert "wrote 30,000 clustered points" in capsys.readouterr().out
    assert pq.ParquetFile(out).metadata.num_rows == 30_000
    assert main(["load", str(out), "--name", "gen", "--target", server]) == 0
    assert "loaded 30,000 rows into gen" in capsys.readouterr().out
    assert client.info("gen").rows == 30_000
    assert main(["load", str(out), "--name", "gen", "--target", server]) == 1
    assert "exists" in capsys.readouterr().err.lower()
    assert (
        main(
            ["load", str(out), "--name", "gen", "--mode", "replace", "--target", server, "--quiet"]
        )
        == 0
    )


def test_cli_load_bad_file_names_rows_and_skip_invalid(
    server: str, client: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("id,lat,lon\n1,10,10\n2,95,10\n3,x,10\n4,20,20\n")
    assert main(["load", str(path), "--name", "badcsv", "--target", server]) == 2
    err = capsys.readouterr().err
    assert "2 of 4 rows are invalid" in err and "row 1: lat='95'" in err
    assert "badcsv" not in {d.name for d in client.datasets()}
    assert main(["load", str(path), "--name", "badcsv", "--skip-invalid", "--target", server]) == 0
    assert "dropped 2 invalid rows" in capsys.readouterr().out
    assert client.info("badcsv").rows == 2


def test_cli_load_bundled_and_knn_matches_a_float64_reference(
    server: str, client: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["load", "airports", "--target", server]) == 0
    airports = load_bundled("airports")
    queries = tmp_path / "queries.csv"
    queries.write_text(
        "place,latitude,longitude\nparis,48.8566,2.3522\nfiji,-17.7,178.9\nsouth pole,-90,0\n"
    )
    out = tmp_path / "near.parquet"
    assert (
        main(
            [
                "knn",
                "airports",
                "--queries",
                str(queries),
                "-k",
                "5",
                "--out",
                str(out),
                "--columns",
                "name",
                "--target",
                server,
            ]
        )
        == 0
    )
    assert "wrote 15 rows" in capsys.readouterr().out
    result = pq.read_table(out).to_pandas()
    q_lat, q_lon = read_query_points(queries)
    a_lat = airports.column("lat").to_numpy()
    a_lon = airports.column("lon").to_numpy()
    ids = np.asarray(airports.column("id").to_pylist())
    for qi in range(3):
        d = great_circle_m(q_lat[qi], q_lon[qi], a_lat, a_lon)
        order = np.argsort(d, kind="stable")[:5]
        got = result[result.query_index == qi]
        assert got["id"].tolist() == ids[order].tolist()
        np.testing.assert_allclose(got["distance_m"], d[order], rtol=0, atol=1e-3)
    for suffix in ("csv", "arrow"):
        path = tmp_path / f"radius.{suffix}"
        assert (
            main(
                [
                    "radius",
                    "airports",
                    "--queries",
                    str(queries),
                    "--radius-m",
                    "20000",
                    "--out",
                    str(path),
                    "--target",
                    server,
                ]
            )
            == 0
        )
        written = (
            pd.read_csv(path)
            if suffix == "csv"
            else pa.ipc.open_file(str(path)).read_all().to_pandas()
        )
        d = great_circle_m(q_lat[0], q_lon[0], a_lat, a_lon)
        assert (written.query_index == 0).sum() == int((d <= 20000).sum())


def test_cli_matrix_queries_to_parquet(server: str, tmp_path: Path) -> None:
    queries = tmp_path / "q.parquet"
    pq.write_table(pa.table({"lat": [0.0, 10.0], "lon": [0.0, 0.0]}), queries)
    out = tmp_path / "m.parquet"
    assert (
        main(
            [
                "matrix",
                "--queries",
                str(queries),
                "--lat2",
                "0,0",
                "--lon2",
                "0,90",
                "--out",
                str(out),
                "--target",
                server,
            ]
        )
        == 0
    )
    m = pq.read_table(out).to_pandas()
    assert len(m) == 4
    cell = m[(m.query_index == 1) & (m.column_index == 0)]["distance_m"].item()
    assert abs(cell - great_circle_m(10.0, 0.0, 0.0, 0.0)) < 1e-3
    assert main(["knn", "x", "--target", server]) == 2  # neither --lat/--lon nor --queries


def test_write_table_formats_round_trip(tmp_path: Path) -> None:
    frame = pd.DataFrame({"a": [1, 2], "b": ["x", "y"]})
    for suffix in ("parquet", "csv", "arrow"):
        assert write_table(frame, tmp_path / f"t.{suffix}") == 2
    assert pq.read_table(tmp_path / "t.parquet").to_pandas().equals(frame)
    with pytest.raises(ValueError, match="cannot tell the format"):
        write_table(frame, tmp_path / "t.xlsx")


# -- bounded memory while streaming --------------------------------------------------------
# VmHWM, not getrusage's ru_maxrss: the latter keeps the forking parent's peak across exec.
_PEAK = textwrap.dedent("""
    import sys
    from geonear.clients.cli import main
    code = main(sys.argv[1:])
    status = open("/proc/self/status").read()
    print("PEAK_KB", status.split("VmHWM:")[1].split()[0])
    sys.exit(code)
""")


def _peak_load_kb(path: Path, name: str, server: str) -> int:
    run = subprocess.run(
        [
            PYTHON,
            "-c",
            _PEAK,
            "load",
            str(path),
            "--name",
            name,
            "--row-ids",
            "--target",
            server,
            "--timeout-s",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split("PEAK_KB")[1].split()[0])


@pytest.mark.slow
def test_loading_streams_with_bounded_memory(server: str, client: Client, tmp_path: Path) -> None:
    small, large = tmp_path / "small.parquet", tmp_path / "large.parquet"
    write_points(small, 200_000, seed=1)
    write_points(large, 2_000_000, seed=1)
    small_kb = _peak_load_kb(small, "mem_small", server)
    large_kb = _peak_load_kb(large, "mem_large", server)
    assert client.info("mem_large").rows == 2_000_000
    # 1.8M more rows hold 58 MB per copy (row id, id_original, lat, lon); a client that
    # held the table would peak at least that much higher (measured: about 80 MB), one
    # that streams about 20-30 MB (allocator noise).
    print(f"peak RSS of the load: {small_kb} kB (200k rows), {large_kb} kB (2M rows)")
    assert large_kb - small_kb < 45_000, (small_kb, large_kb)


@pytest.mark.skipif(
    not os.environ.get("GEONEAR_BIG_LOAD"),
    reason="10M-row load: set GEONEAR_BIG_LOAD=1 to run by hand",
)
def test_ten_million_rows_load_with_bounded_memory(
    server: str, client: Client, tmp_path: Path
) -> None:
    path = tmp_path / "ten_million.parquet"
    write_points(path, 10_000_000, clustered=True, seed=1)
    peak_kb = _peak_load_kb(path, "ten_million", server)
    assert client.info("ten_million").rows == 10_000_000
    print(f"peak RSS of the 10M-row load: {peak_kb} kB")
    assert peak_kb < 600_000, peak_kb


# -- the analyst notebook ------------------------------------------------------------------
@pytest.mark.slow
def test_analyst_notebook_runs_headless(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.read(ROOT / "examples" / "analyst.ipynb", as_version=4)
    nbformat.validate(notebook)
    nbclient.NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "".join(o.get("text", "") for o in outputs)
    assert "rows into airports" in text
    assert "id <- row numbers" in text
    # The sections after k-means: the join, DBSCAN and the areas, with their maps.
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3
    assert "34006 cities joined to their nearest airport" in text
    dbscan = re.search(r"(\d+) DBSCAN clusters, (\d+) noise points of (\d+) cities", text)
    assert dbscan, text
    n_clusters, n_noise, n_points = map(int, dbscan.groups())
    assert n_clusters > 0 and n_noise < n_points
    assert re.search(r"\b[1-9]\d* cities in the box across the antimeridian", text)
    assert re.search(r"\b[1-9]\d* cities in the polygon", text)
