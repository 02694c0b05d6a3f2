"""gRPC clients the actor calls: the reward service (here) and the replay service (services.replay.client).

Each call has a deadline and is retried as the caller's `RetryPolicy` says; a failure past it surfaces
as its domain error (Unavailable, ResourceExhausted, NotFound, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common import telemetry
from services.common.grpcutil import RetryPolicy, channel, retry
from services.proto.fleetrl.v1 import reward_pb2, reward_pb2_grpc


class RewardClient:
    """One channel to a reward service."""

    addr: str
    timeout_s: float
    retry: RetryPolicy

    def __init__(self, addr: str, *, timeout_s: float, retry: RetryPolicy | None = None) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._channel: grpc.aio.Channel = channel(addr)
        self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)

    async def score(self, job_id: str, spec_json: str, file_source: bytes,
                    items: Sequence[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]:
        """One result per item, in order."""
        request = reward_pb2.ScoreRequest(
            job_id=job_id, spec=reward_pb2.RewardSpec(spec_json=spec_json, file_source=file_source), items=items)
        response = await retry(
            lambda: self._stub.Score(request, timeout=self.timeout_s, metadata=telemetry.grpc_metadata()),
            what="reward Score", policy=self.retry)
        return list(response.results)

    async def close(self) -> None:
        await self._channel.close()
