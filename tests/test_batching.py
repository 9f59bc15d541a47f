"""Dynamic batching: batched and unbatched answers are identical; queue deadlines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.batching import Batcher, QueueDeadlineExceeded
from geonear.service.engines.cpu import KDTreeIndex


class SlowIndex(KDTreeIndex):
    """A real cKDTree index whose queries take at least ``delay_s`` longer."""

    delay_s = 0.3

    def knn(self, lat, lon, k, max_distance_m=None):
        time.sleep(self.delay_s)
        return super().knn(lat, lon, k, max_distance_m)


@pytest.fixture(scope="module")
def index() -> KDTreeIndex:
    lat, lon = clustered_points(30_000, seed=2)
    # Duplicates make ties at the k-th neighbour, which must still split exactly.
    lat = np.concatenate([lat, lat[:500]])
    lon = np.concatenate([lon, lon[:500]])
    return KDTreeIndex(lat, lon, 6_371_008.8)


def _awaited_together(calls: list[Callable[[], Awaitable[object]]]) -> list:
    """Every call awaited concurrently on one event loop, as the server's handlers are."""

    async def all_of_them() -> list:
        return await asyncio.gather(*(call() for call in calls))

    return asyncio.run(all_of_them())


def test_concurrent_knn_batched_equals_unbatched(index: KDTreeIndex) -> None:
    batcher = Batcher(max_points=256, max_delay_us=2000)
    lat, lon = uniform_points(400, seed=9)
    lat[:50], lon[:50] = index.lat[:50], index.lon[:50]  # queries on duplicated points
    ks = [1 + (i % 17) for i in range(400)]
    bounds = [None if i % 3 else 500_000.0 for i in range(400)]

    def one(i: int) -> Callable[[], Awaitable[object]]:
        return lambda: batcher.knn(index, lat[i : i + 1], lon[i : i + 1], ks[i], bounds[i], 30.0)

    try:
        got = _awaited_together([one(i) for i in range(400)])
    finally:
        batcher.close()
    assert batcher.batches < batcher.requests  # requests really were coalesced
    for i, result in enumerate(got):
        want = index.knn(lat[i : i + 1], lon[i : i + 1], ks[i], bounds[i])
        np.testing.assert_array_equal(result.indices, want.indices)
        np.testing.assert_array_equal(result.distances_m, want.distances_m)


def test_concurrent_radius_batched_equals_unbatched(index: KDTreeIndex) -> None:
    batcher = Batcher(max_points=128, max_delay_us=2000)
    lat, lon = index.lat[:200] + 0.05, index.lon[:200]
    radii = [20_000.0 if i % 2 else 50_000.0 for i in range(200)]

    def one(i: int) -> Callable[[], Awaitable[object]]:
        return lambda: batcher.radius(index, lat[i : i + 1], lon[i : i + 1], radii[i])

    try:
        got = _awaited_together([one(i) for i in range(200)])
    finally:
        batcher.close()
    assert batcher.batches < batcher.requests
    for i, result in enumerate(got):
        want = index.radius(lat[i : i + 1], lon[i : i + 1], radii[i])
        np.testing.assert_array_equal(result.offsets, want.offsets)
        np.testing.assert_array_equal(result.indices, want.indices)
        np.testing.assert_array_equal(result.distances_m, want.distances_m)


def _around_a_waiting_request(
    index: KDTreeIndex,
    seed: int,
    middle: Callable[[Batcher, SlowIndex, np.ndarray, np.ndarray], Awaitable[None]],
) -> Batcher:
    """A slow first request, ``middle`` while it runs, then a last one; returns the batcher.

    ``middle`` gets the batcher, the slow index and the second query point (lat, lon).
    The first and last answers are checked against the index.
    """
    slow = SlowIndex(index.lat, index.lon, index.earth_radius_m)
    batcher = Batcher(max_points=64, max_delay_us=0)
    lat, lon = uniform_points(3, seed=seed)

    async def scenario() -> tuple:
        first = asyncio.ensure_future(batcher.knn(slow, lat[:1], lon[:1], 5, None))
        await asyncio.sleep(0.1)  # the dispatcher is now busy with the first request
        await middle(batcher, slow, lat[1:2], lon[1:2])
        return await first, await batcher.knn(slow, lat[2:3], lon[2:3], 5, None, 30)

    try:
        first, after = asyncio.run(scenario())
    finally:
        batcher.close()
    np.testing.assert_array_equal(first.indices, index.knn(lat[:1], lon[:1], 5).indices)
    np.testing.assert_array_equal(after.indices, index.knn(lat[2:3], lon[2:3], 5).indices)
    return batcher


def test_an_awaited_request_past_its_deadline_leaves_the_batch_alone(index: KDTreeIndex) -> None:
    async def expires(batcher: Batcher, slow: SlowIndex, lat: np.ndarray, lon: np.ndarray) -> None:
        with pytest.raises(QueueDeadlineExceeded):
            await batcher.knn(slow, lat, lon, 5, None, timeout_s=0.05)

    batcher = _around_a_waiting_request(index, 1, expires)
    assert batcher.requests == 2  # the expired request never reached the engine


def test_a_cancelled_awaited_request_never_reaches_the_engine(index: KDTreeIndex) -> None:
    async def leaves(batcher: Batcher, slow: SlowIndex, lat: np.ndarray, lon: np.ndarray) -> None:
        waiting = asyncio.ensure_future(batcher.knn(slow, lat, lon, 5, None))
        await asyncio.sleep(0.01)
        waiting.cancel()  # its caller went away while it waited in the queue
        with pytest.raises(asyncio.CancelledError):
            await waiting

    batcher = _around_a_waiting_request(index, 4, leaves)
    assert batcher.requests == 2  # the cancelled request was dropped from the queue
