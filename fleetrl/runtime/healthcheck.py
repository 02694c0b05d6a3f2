"""`python -m fleetrl.runtime.healthcheck HOST:PORT [SERVICE]`: exit 0 iff the gRPC health check says SERVING.

Used by docker-compose health checks; the deadline is bounded so a hung server reads as unhealthy.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m fleetrl.runtime.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    return 0 if check(args[0], args[1] if len(args) > 1 else "") else 1


if __name__ == "__main__":
    sys.exit(main())
