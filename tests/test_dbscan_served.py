"""Dbscan served: the RPC, the client and the command line against the domain function
and scikit-learn.

A small clustered set, with a cluster across the antimeridian, is clustered by a real
server on port 0; labels equal ``geonear.service.analytics.dbscan``'s and
scikit-learn's up to relabelling, a filter clusters only the points it selects, and a
call that cannot finish in its deadline ends DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from test_dbscan import assert_matches_sklearn

from geonear.clients.cli import main
from geonear.clients.client import Client, DbscanOutcome
from geonear.clients.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.analytics import dbscan
from geonear.service.settings import Limits

EPS_M, MIN_SAMPLES = 3_000.0, 5


def _points() -> tuple[np.ndarray, np.ndarray]:
    lat, lon = clustered_points(800, seed=21, n_clusters=8, spread_m=10_000.0)
    # One cluster straddling 180 degrees, and a few lone points (noise).
    rng = np.random.default_rng(22)
    am_lat = rng.normal(10.0, 0.01, 120)
    am_lon = (180.0 + rng.normal(0.0, 0.01, 120) + 180.0) % 360.0 - 180.0
    lone_lat, lone_lon = uniform_points(30, seed=23)
    return np.concatenate([lat, am_lat, lone_lat]), np.concatenate([lon, am_lon, lone_lon])


LAT, LON = _points()
N = LAT.shape[0]
TABLE = pa.table({"id": np.arange(N) * 10, "lat": LAT, "lon": LON, "kind": np.arange(N) % 3})


@pytest.fixture
def loaded(client: Client) -> Client:
    client.upload("places", TABLE)
    return client


def _labels_by_row(outcome: DbscanOutcome, ids: np.ndarray) -> np.ndarray:
    assert outcome.labels is not None
    labels = outcome.labels
    np.testing.assert_array_equal(labels["id"].to_numpy(), ids)
    assert labels["cluster"].dtype == np.int64
    return labels["cluster"].to_numpy()


def test_dbscan_equals_the_domain_function_and_scikit_learn(loaded: Client) -> None:
    out = loaded.dbscan("places", EPS_M, MIN_SAMPLES)
    mine = dbscan(LAT, LON, EPS_M, MIN_SAMPLES)
    np.testing.assert_array_equal(_labels_by_row(out, TABLE["id"].to_numpy()), mine.labels)
    assert out.n_clusters == mine.n_clusters and out.n_noise == mine.n_noise
    assert out.sizes == tuple(mine.sizes.tolist())
    assert out.dataset_version == 1 and out.earth_radius_m > 6e6
    assert_matches_sklearn(mine, LAT, LON, EPS_M, MIN_SAMPLES)
    # The antimeridian cluster is one cluster.
    across = mine.labels[800:920]
    assert (across >= 0).all() and len(np.unique(across)) == 1
    assert (LON[800:920] > 0).any() and (LON[800:920] < 0).any()
    assert "n_clusters=" in repr(out) and f"<{N} rows>" in repr(out)


def test_dbscan_summary_only_sends_no_labels(loaded: Client) -> None:
    out = loaded.dbscan("places", EPS_M, MIN_SAMPLES, return_labels=False)
    assert out.labels is None and "labels=None" in repr(out)
    assert sum(out.sizes) + out.n_noise == N


def test_dbscan_clusters_only_the_points_where_selects(loaded: Client) -> None:
    out = loaded.dbscan("places", EPS_M, MIN_SAMPLES, where=[("kind", "==", 1)])
    rows = np.flatnonzero(np.arange(N) % 3 == 1)
    mine = dbscan(LAT[rows], LON[rows], EPS_M, MIN_SAMPLES)
    np.testing.assert_array_equal(_labels_by_row(out, rows * 10), mine.labels)
    assert out.n_clusters == mine.n_clusters
    none = loaded.dbscan("places", EPS_M, MIN_SAMPLES, where=[("kind", "<", 0)])
    assert none.n_clusters == 0 and none.labels is not None and len(none.labels) == 0


@pytest.mark.parametrize(
    ("eps_m", "min_samples", "words"),
    [(0.0, 5, "eps_m"), (float("nan"), 5, "eps_m"), (-1.0, 5, "eps_m"), (100.0, 0, "min_samples")],
)
def test_bad_parameters_are_invalid_argument(
    loaded: Client, eps_m: float, min_samples: int, words: str
) -> None:
    with pytest.raises(InvalidArgument, match=words):
        loaded.dbscan("places", eps_m, min_samples)


def test_too_many_neighbours_is_resource_exhausted_naming_the_limit(server_factory) -> None:
    running = server_factory(data_dir=None, limits=Limits(max_dbscan_pairs=10_000))
    with Client(running.target) as client:
        client.upload("places", TABLE)
        with pytest.raises(ResourceExhausted, match="max_dbscan_pairs=10000"):
            client.dbscan("places", 2.0e7, 5)


def test_labels_beyond_max_result_rows_are_refused(server_factory) -> None:
    running = server_factory(data_dir=None, limits=Limits(max_result_rows=100))
    with Client(running.target) as client:
        client.upload("places", TABLE)
        with pytest.raises(ResourceExhausted, match="max_result_rows"):
            client.dbscan("places", EPS_M, MIN_SAMPLES)
        assert client.dbscan("places", EPS_M, MIN_SAMPLES, return_labels=False).n_clusters


def test_a_short_deadline_on_a_large_eps_ends_the_call(server_factory) -> None:
    running = server_factory(data_dir=None)
    lat, lon = uniform_points(40_000, seed=24)
    with Client(running.target, timeout_s=120) as client:
        client.upload("many", pa.table({"lat": lat, "lon": lon}))
    with (
        Client(running.target, timeout_s=0.3) as hurried,
        pytest.raises((DeadlineExceeded, ResourceExhausted)),
    ):
        hurried.dbscan("many", 1.5e6, 5)
    # The server is still answering.
    with Client(running.target, timeout_s=60) as client:
        assert client.dbscan("many", 1.0, 2, return_labels=False).n_noise == 40_000


def test_cli_dbscan_writes_the_labels(loaded: Client, server, tmp_path: Path) -> None:
    out = tmp_path / "labels.csv"
    code = main(
        [
            "dbscan",
            "places",
            "--eps-m",
            str(EPS_M),
            "--min-samples",
            str(MIN_SAMPLES),
            "--where",
            "kind == 1",
            "--target",
            server.target,
            "--out",
            str(out),
        ]
    )
    assert code == 0
    written = pd.read_csv(out)
    expected = loaded.dbscan("places", EPS_M, MIN_SAMPLES, where=[("kind", "==", 1)])
    assert expected.labels is not None
    pd.testing.assert_frame_equal(written, expected.labels)
