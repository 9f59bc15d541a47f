"""An error no layer answers reaches the client as INTERNAL with an error id, never as
UNKNOWN with a Python class; what an engine says it cannot do is UNIMPLEMENTED.

A real server on port 0 whose dataset's index is a real PointIndex that fails.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import grpc
import numpy as np
import pyarrow as pa
import pytest

from geonear.clients.client import Client
from geonear.service.engines.reference import ReferenceEngine
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import points_to_message


def _failing_index(points: int, error: Exception):
    """A reference index over ``points`` points whose searches raise ``error``."""
    index = ReferenceEngine().build_index(np.zeros(points), np.linspace(-10, 10, points))

    class Failing(type(index)):  # type: ignore[misc]
        def knn(self, *args, **kwargs):
            raise error

        radius = radius_count = knn

    index.__class__ = Failing
    return index


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ValueError("a stray bug"), grpc.StatusCode.INTERNAL),
        (KeyError("oops"), grpc.StatusCode.INTERNAL),
        (NotImplementedError("this engine has no radius search"), grpc.StatusCode.UNIMPLEMENTED),
    ],
)
def test_an_unexpected_error_is_internal_with_an_id_the_log_carries(
    server_factory, caplog, error, code
):
    caplog.set_level(logging.ERROR, logger="geonear.errors")
    server = server_factory(data_dir=None)
    with Client(server.target) as client:
        client.upload(
            "pts",
            pa.table({"id": np.arange(50), "lat": np.zeros(50), "lon": np.linspace(-10, 10, 50)}),
        )
    version = server.store.get("pts")
    server.store._datasets["pts"] = dataclasses.replace(version, index=_failing_index(50, error))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        queries = points_to_message(np.zeros(3), np.zeros(3))
        for call in (
            lambda: stub.KnnCompact(pb.KnnRequest(dataset="pts", k=2, queries=queries)),
            lambda: list(stub.Knn(pb.KnnRequest(dataset="pts", k=2, queries=queries))),
        ):
            with pytest.raises(grpc.RpcError) as failed:
                call()
            assert failed.value.code() == code
            details = failed.value.details()
            assert "Unexpected" not in details and "<class" not in details
            if code == grpc.StatusCode.INTERNAL:
                error_id = re.search(r"internal error ([0-9a-f]{12})", details).group(1)
                assert any(error_id in r.getMessage() for r in caplog.records)
            else:
                assert "no radius search" in details
        # The server still answers.
        assert stub.ListDatasets(pb.ListDatasetsRequest()).datasets[0].name == "pts"
