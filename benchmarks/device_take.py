"""Result columns gathered on the device (cuDF) against pyarrow's take on the host.

Run on a GPU host with RAPIDS: ``python3 benchmarks/device_take.py``. Builds a 1M-row
table (int64 id, a string and an int64 attribute), then times, for several result sizes,
``DeviceTable.take`` (rows up, gather, one Arrow copy back) against the host table's
``take``, best of 3 each. The crossover sets ``gpu_table.DEVICE_TAKE_FROM``.
"""

import time

import cupy as cp
import numpy as np
import pyarrow as pa

from geonear.service.engines import gpu_memory
from geonear.service.engines.gpu_table import DeviceTable


def best_ms(fn, repeat=3):
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


gpu_memory.initialise_pool(None)
n = 1_000_000
rng = np.random.default_rng(0)
table = pa.table(
    {
        "id": np.arange(n, dtype=np.int64),
        "name": pa.array([f"place {i}" for i in range(n)]),
        "pop": rng.integers(0, 10**6, n),
    }
)
for label in ("first", "second"):
    start = time.perf_counter()
    device = DeviceTable.from_arrow(table)
    cp.cuda.Device().synchronize()
    print(f"from_arrow of 1M rows ({label} call): {1e3 * (time.perf_counter() - start):.1f} ms")
assert device is not None
print(f"device columns {sorted(device.columns)}, {device.nbytes / n:.1f} bytes a row")
for names in (["id"], ["id", "name", "pop"]):
    for m in (10_000, 65_536, 262_144, 1_000_000, 10_000_000):
        rows = rng.integers(0, n, m)

        def host(rows=rows, names=names):
            taken = pa.array(rows, type=pa.int64())
            return {c: table.column(c).take(taken) for c in names}

        def on_device(rows=rows, names=names):
            return device.take(names, rows)

        h, d = best_ms(host), best_ms(on_device)
        print(f"take {','.join(names):>11} {m:>10,} rows: host {h:8.2f} ms, device {d:8.2f} ms")
