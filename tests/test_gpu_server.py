"""The GPU backend served: same answers as the CPU server, and out of memory survived.

A real ``geonear serve --backend gpu`` in a process of its own (the device memory pool
is per process, so its small fixed size cannot leak into the other tests), next to an
in-process CPU server with the same datasets. Runs on a GPU machine (``pytest -m gpu``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from server_process import start_server

from geonear.clients.client import Client
from geonear.clients.errors import ResourceExhausted
from geonear.loaders.synthetic import uniform_points
from geonear.service.engines import gpu_available
from geonear.service.engines.gpu_table import cudf_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available()[0], reason=f"no usable GPU: {gpu_available()[1]}"),
]

#: The GPU server's pool, and its limit: small enough to run out of.
POOL_BYTES = 128 << 20


def _places(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    lat, lon = uniform_points(n, seed=seed)
    return pa.table(
        {
            "id": np.arange(n, dtype=np.int64) * 7 + 3,
            "lat": lat,
            "lon": lon,
            "name": pa.array([f"place {i}" for i in range(n)]),
            "population": pa.array(rng.integers(0, 10**6, n), mask=rng.random(n) < 0.1),
            "kind": pa.array(rng.choice(["town", "city", "port"], n)).dictionary_encode(),
        }
    )


@pytest.fixture(scope="module")
def gpu_target(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("gpu-server")
    args = ["-m", "geonear", "serve", "--port", "0", "--data-dir", str(workdir / "data"),
            "--backend", "gpu", "--gpu-pool-size-bytes", str(POOL_BYTES)]  # fmt: skip
    proc, target = start_server(args, workdir / "server.log", workdir, timeout_s=180)
    try:
        yield target
    finally:
        proc.terminate()
        proc.wait(60)


def _same_rows(got: pa.Table, expected: pa.Table) -> None:
    assert got.schema.remove_metadata() == expected.schema.remove_metadata()
    for name in got.column_names:
        if name == "distance_m":
            np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-3)
        else:
            assert got[name].equals(expected[name]), name


def test_the_gpu_server_answers_as_the_cpu_server_with_attributes(
    gpu_target, server_factory, airports_table
) -> None:
    places = _places(200_000, seed=41)
    lat, lon = uniform_points(100_000, seed=42)
    columns = ["name", "population", "kind"]
    cpu = server_factory(data_dir=None)
    with Client(gpu_target, timeout_s=120) as on_gpu, Client(cpu.target, timeout_s=120) as on_cpu:
        info = on_gpu.server_info()
        assert info.backend == "gpu" and "pool 0.1 GiB" in info.device
        for client in (on_gpu, on_cpu):
            client.upload("places", places)
            client.upload("airports", airports_table)
        per_point = on_gpu.info("places").device_bytes / places.num_rows
        if cudf_available():  # the index, the ids and the attributes
            assert 60 < per_point < 100
        else:  # the index alone
            assert 24 < per_point < 56
        for name, cols in (("places", columns), ("airports", ["name", "country"])):
            # 300,000 result rows with attributes: gathered on the device
            got = on_gpu.knn(name, lat, lon, k=3, columns=cols, as_arrow=True)
            _same_rows(got, on_cpu.knn(name, lat, lon, k=3, columns=cols, as_arrow=True))
            few = lat[:10_000], lon[:10_000]  # about 28 points each in places: 280,000 rows
            got = on_gpu.radius(name, *few, 150_000.0, columns=cols, as_arrow=True)
            _same_rows(got, on_cpu.radius(name, *few, 150_000.0, columns=cols, as_arrow=True))
        on_gpu.drop("places")
        on_gpu.drop("airports")


def test_running_out_of_device_memory_is_resource_exhausted_and_the_server_goes_on(
    gpu_target,
) -> None:
    small = _places(20_000, seed=43)
    with Client(gpu_target, timeout_s=120) as client:
        client.upload("small", small)
        before = client.knn("small", 10.0, 20.0, k=5, as_arrow=True)
        # 3M points need about 180 MiB of index and ids: more than the pool holds
        lat, lon = uniform_points(3_000_000, seed=44)
        big = pa.table({"lat": lat, "lon": lon})
        with pytest.raises(ResourceExhausted, match="GPU memory exhausted"):
            client.upload("big", big)
        assert [d.name for d in client.datasets()] == ["small"]
        # k above the register top-k: float64 distances in blocks of 512 MiB
        with pytest.raises(ResourceExhausted, match="GPU memory exhausted during a KNN query"):
            client.knn("small", lat[:2000], lon[:2000], k=1000, as_arrow=True)
        # the server goes on serving, from a pool with room again
        assert client.knn("small", 10.0, 20.0, k=5, as_arrow=True).equals(before)
        used, total = client.server_info().pool_used_bytes, client.server_info().pool_total_bytes
        assert 0 < used < total == POOL_BYTES
        client.upload("replaced", small)
        assert client.info("replaced").rows == small.num_rows
        client.drop("small")
        client.drop("replaced")
