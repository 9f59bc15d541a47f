"""Within served: the points of a dataset in a box or a spherical polygon, through the
RPC, the client and the command line, against brute-force checks.

A box across the antimeridian and a polygon with a hole are checked point by point (the
box by its bounds, the polygon by the domain's mask and by hand for points clearly
inside the shell, the hole, or outside); a filter is honoured; a bad polygon is
INVALID_ARGUMENT with its reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from geonear.clients.cli import main
from geonear.clients.client import Client
from geonear.clients.errors import InvalidArgument, ResourceExhausted
from geonear.loaders.synthetic import uniform_points
from geonear.service.analytics import SphericalPolygon, polygon_mask
from geonear.service.settings import Limits

N = 5000


def _points() -> tuple[np.ndarray, np.ndarray]:
    lat, lon = uniform_points(N - 4, seed=41)
    # A dense patch either side of 180 degrees, and the antimeridian itself.
    rng = np.random.default_rng(42)
    patch_lat = rng.uniform(-12.0, 12.0, 400)
    patch_lon = (rng.uniform(165.0, 195.0, 400) + 180.0) % 360.0 - 180.0
    lat = np.concatenate([lat[:-400], patch_lat, [0.0, 0.0, 5.0, 80.0]])
    lon = np.concatenate([lon[:-400], patch_lon, [180.0, -180.0, 170.0, 0.0]])
    return lat, lon


LAT, LON = _points()
TABLE = pa.table({"id": np.arange(N), "lat": LAT, "lon": LON, "kind": np.arange(N) % 4})
#: A shell of 40 by 40 degrees around (20, 0) with a hole of 10 by 10 around the same centre.
#: (GeoJSON positions are [longitude, latitude].)
SHELL = [[-20.0, 0.0], [20.0, 0.0], [20.0, 40.0], [-20.0, 40.0], [-20.0, 0.0]]
HOLE = [[-5.0, 15.0], [5.0, 15.0], [5.0, 25.0], [-5.0, 25.0], [-5.0, 15.0]]
POLYGON = {"type": "Polygon", "coordinates": [SHELL, HOLE]}


@pytest.fixture
def loaded(client: Client) -> Client:
    client.upload("places", TABLE)
    return client


def test_a_box_across_the_antimeridian_holds_exactly_the_points_in_its_bounds(
    loaded: Client,
) -> None:
    found = loaded.within("places", bbox=(-10.0, 170.0, 10.0, -170.0), columns=["kind"])
    expected = np.flatnonzero((LAT >= -10.0) & (LAT <= 10.0) & ((LON >= 170.0) | (LON <= -170.0)))
    assert list(found.columns) == ["id", "lat", "lon", "kind"]
    np.testing.assert_array_equal(found["id"].to_numpy(), expected)
    np.testing.assert_array_equal(found["lat"].to_numpy(), LAT[expected])
    np.testing.assert_array_equal(found["kind"].to_numpy(), expected % 4)
    assert {N - 4, N - 3, N - 2} <= set(found["id"].tolist())  # 180, -180 and 170 degrees
    assert (found["lon"] > 0).any() and (found["lon"] < 0).any()


def test_a_polygon_with_a_hole_holds_the_points_of_the_shell_outside_the_hole(
    loaded: Client,
) -> None:
    found = loaded.within("places", polygon=POLYGON)
    expected = np.flatnonzero(polygon_mask(LAT, LON, SphericalPolygon.parse(POLYGON)))
    ids = found["id"].to_numpy()
    np.testing.assert_array_equal(ids, expected)
    # By hand, away from the edges (great-circle edges bow from the parallels).
    in_shell = (LAT > 1.0) & (LAT < 39.0) & (np.abs(LON) < 19.0)
    near_hole = (LAT > 14.0) & (LAT < 26.0) & (np.abs(LON) < 6.0)
    clearly_in_hole = (LAT > 16.0) & (LAT < 24.0) & (np.abs(LON) < 4.0)
    clearly_out = (LAT < -1.0) | (LAT > 45.0) | (np.abs(LON) > 21.0)
    inside = np.zeros(N, bool)
    inside[ids] = True
    assert inside[in_shell & ~near_hole].all()
    assert not inside[clearly_in_hole].any() and not inside[clearly_out].any()
    assert clearly_in_hole.any() and (in_shell & ~near_hole).any()


def test_a_polygon_as_wkb_or_a_shapely_geometry_gives_the_same_points(loaded: Client) -> None:
    shapely = pytest.importorskip("shapely")
    shape = shapely.geometry.shape(POLYGON)
    by_geojson = loaded.within("places", polygon=json.dumps(POLYGON))
    pd.testing.assert_frame_equal(loaded.within("places", polygon=shape), by_geojson)
    pd.testing.assert_frame_equal(loaded.within("places", polygon=shape.wkb), by_geojson)


def test_within_honours_where(loaded: Client) -> None:
    found = loaded.within("places", polygon=POLYGON, where=[("kind", "==", 2)], as_arrow=True)
    assert isinstance(found, pa.Table)
    mask = polygon_mask(LAT, LON, SphericalPolygon.parse(POLYGON)) & (np.arange(N) % 4 == 2)
    np.testing.assert_array_equal(found["id"].to_numpy(), np.flatnonzero(mask))
    assert found.schema.metadata[b"geonear.dataset"] == b"places"


@pytest.mark.parametrize(
    ("polygon", "words"),
    [
        ({"type": "Polygon", "coordinates": [[[0, 0], [1, 0], [1, 1], [0, 2]]]}, "closed"),
        ({"type": "Point", "coordinates": [0, 0]}, "Polygon"),
        ("not json", "polygon"),
        (b"\x01\x03\x00", "polygon"),
        ({"type": "Polygon", "coordinates": [[[0, 0], [2, 2], [2, 0], [0, 2], [0, 0]]]}, "polygon"),
    ],
)
def test_a_bad_polygon_is_invalid_argument_with_the_reason(
    loaded: Client, polygon: object, words: str
) -> None:
    with pytest.raises(InvalidArgument, match=words) as caught:
        loaded.within("places", polygon=polygon)
    assert "polygon" in str(caught.value)


def test_a_bad_box_is_invalid_argument(loaded: Client) -> None:
    with pytest.raises(InvalidArgument, match="min_lat"):
        loaded.within("places", bbox=(10.0, 0.0, -10.0, 5.0))


def test_more_points_than_max_result_rows_are_refused(server_factory) -> None:
    running = server_factory(data_dir=None, limits=Limits(max_result_rows=10))
    with Client(running.target) as client:
        client.upload("places", TABLE)
        with pytest.raises(ResourceExhausted, match="max_result_rows"):
            client.within("places", bbox=(-90.0, -180.0, 90.0, 180.0))


def test_cli_within_box_and_polygon(loaded: Client, server, tmp_path: Path) -> None:
    out = tmp_path / "box.csv"
    code = main(
        ["within", "places", "--bbox=-10,170,10,-170", "--target", server.target, "--out", str(out)]
    )
    assert code == 0
    expected = loaded.within("places", bbox=(-10.0, 170.0, 10.0, -170.0))
    np.testing.assert_array_equal(pd.read_csv(out)["id"].to_numpy(), expected["id"].to_numpy())
    shape = tmp_path / "area.geojson"
    shape.write_text(json.dumps(POLYGON))
    out = tmp_path / "polygon.csv"
    args = ["within", "places", "--polygon", str(shape), "--where", "kind == 2"]
    assert main([*args, "--columns", "kind", "--target", server.target, "--out", str(out)]) == 0
    expected = loaded.within("places", polygon=POLYGON, columns="kind", where=[("kind", "==", 2)])
    pd.testing.assert_frame_equal(pd.read_csv(out), expected)
