"""Health-only gRPC servers, sync thread pool or grpc.aio: the per-call cost of each.

python benchmarks/ping_servers.py sync 51001 &   # or: aio 51001
geonear loadtest --target 127.0.0.1:51001 --scenario ping --concurrency 64 --duration 8
"""

import asyncio
import sys
from concurrent import futures

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

mode, port = sys.argv[1], int(sys.argv[2])
if mode == "sync":
    s = grpc.server(
        futures.ThreadPoolExecutor(max_workers=int(sys.argv[3]) if len(sys.argv) > 3 else 16)
    )
    h = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, s)
    h.set("", health_pb2.HealthCheckResponse.SERVING)
    s.add_insecure_port(f"127.0.0.1:{port}")
    s.start()
    print("ready", flush=True)
    s.wait_for_termination()
else:

    async def main():
        s = grpc.aio.server()
        h = health_async.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(h, s)
        await h.set("", health_pb2.HealthCheckResponse.SERVING)
        s.add_insecure_port(f"127.0.0.1:{port}")
        await s.start()
        print("ready", flush=True)
        await s.wait_for_termination()

    if len(sys.argv) > 3 and sys.argv[3] == "uvloop":
        import uvloop

        uvloop.install()
    asyncio.run(main())
