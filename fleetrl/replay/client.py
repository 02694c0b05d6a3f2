"""Async client of the ReplayService for actors and the learner.

Every call has a deadline and is retried with bounded backoff on UNAVAILABLE,
RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED (`grpcutil.retry`; a caller may give its own
`RetryPolicy`, as the actor does); other failures raise their domain error (NotFound,
InvalidArgument, ...). Retrying is safe: Insert is
idempotent (a retried group reports DUPLICATE) and a second Commit is a no-op.
A call past its deadline sends the next ones down a new connection (`grpcutil.RenewingChannel`): a
half-open connection to a service that went away costs one deadline, not grpc's keepalive.
Each call carries the caller's trace context as gRPC metadata (W3C traceparent).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc

from fleetrl.proto.fleetrl.v1 import common_pb2, replay_pb2, replay_pb2_grpc
from fleetrl.replay import wire
from fleetrl.replay.samplers import SAMPLERS
from fleetrl.runtime import telemetry
from fleetrl.runtime.grpcutil import RenewingChannel, RetryPolicy, retry
from fleetrl.spec.config import ReplayConfig

INSERT_METHOD = "/fleetrl.v1.ReplayService/Insert"
INSERTED = replay_pb2.INSERT_OUTCOME_INSERTED
DUPLICATE = replay_pb2.INSERT_OUTCOME_DUPLICATE


@dataclass(frozen=True)
class Stubs:
    """The calls of one channel: the service's stub, and Insert taking the request's bytes."""

    replay: replay_pb2_grpc.ReplayServiceStub
    insert_raw: grpc.aio.UnaryUnaryMultiCallable

    @classmethod
    def bind(cls, channel: grpc.aio.Channel) -> Stubs:
        return cls(replay_pb2_grpc.ReplayServiceStub(channel), channel.unary_unary(
            INSERT_METHOD, request_serializer=None, response_deserializer=replay_pb2.InsertResponse.FromString))


class ReplayClient:
    """One channel to a replay service; use as `async with ReplayClient(addr) as replay:`."""

    addr: str
    timeout_s: float
    retry: RetryPolicy

    def __init__(self, addr: str, *, timeout_s: float = 10.0, attempts: int = 5,
                 retry: RetryPolicy | None = None) -> None:
        """`retry` (default: up to `attempts` tries on the retryable codes) says when a call is tried again."""
        self.addr = addr
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy(attempts=attempts)
        self._channel = RenewingChannel(addr, Stubs.bind)

    async def configure(self, job_id: str, cfg: ReplayConfig, lease_epoch: int = 0) -> replay_pb2.TableInfo:
        """Create or update the job's table from the JobSpec's replay section, raising its fence to
        lease_epoch (FailedPrecondition below it)."""
        req = replay_pb2.ConfigureTableRequest(
            job_id=job_id, capacity_groups=cfg.capacity_groups, sampler=SAMPLERS[cfg.sampler].kind,
            max_reuse=cfg.max_reuse, lease_timeout_s=cfg.lease_timeout_s, lease_epoch=lease_epoch)
        return await self._call("ConfigureTable", req)

    async def insert(self, groups: Sequence[common_pb2.Group]) -> list[int]:
        """Insert groups; one InsertOutcome (INSERTED or DUPLICATE) per group, in order.

        The request is built from each group's bytes (`wire`): `InsertRequest(groups=...)` would
        first deep-copy every group, which costs more than serialising it."""
        request = wire.append_field(b"", wire.INSERT_GROUPS_FIELD, [g.SerializeToString() for g in groups])
        resp = await self._call("Insert", request, raw=True)
        return list(resp.outcomes)

    async def sample(self, job_id: str, max_groups: int, min_policy_version: int = 0, wait_s: float = 0.0,
                     seed: int = 0) -> tuple[str, list[common_pb2.Group], int]:
        """Lease up to max_groups groups: (lease_id or "" if none, groups, stale_dropped)."""
        req = replay_pb2.SampleRequest(job_id=job_id, max_groups=max_groups,
                                       min_policy_version=min_policy_version, wait_s=wait_s, seed=seed)
        resp = await self._call("Sample", req, extra_s=wait_s)
        return resp.lease_id, list(resp.groups), resp.stale_dropped

    async def commit(self, job_id: str, lease_id: str, lease_epoch: int = 0) -> int:
        """Consume a lease's groups; 0 if committed before. NotFound if unknown or expired;
        FailedPrecondition when lease_epoch is below the table's fence."""
        resp = await self._call("Commit", replay_pb2.CommitRequest(job_id=job_id, lease_id=lease_id,
                                                                   lease_epoch=lease_epoch))
        return int(resp.committed_groups)

    async def release(self, job_id: str, lease_id: str) -> int:
        """Give a lease's groups back now; the number returned."""
        resp = await self._call("Release", replay_pb2.ReleaseRequest(job_id=job_id, lease_id=lease_id))
        return int(resp.released_groups)

    async def renew(self, job_id: str, lease_ids: Sequence[str]) -> list[str]:
        """Extend open leases to the table's lease timeout from now; returns the ids not open any more."""
        resp = await self._call("Renew", replay_pb2.RenewRequest(job_id=job_id, lease_ids=lease_ids))
        return list(resp.missing_lease_ids)

    async def stats(self, job_id: str) -> replay_pb2.TableStats:
        return await self._call("Stats", replay_pb2.StatsRequest(job_id=job_id))

    async def query(self, job_id: str, min_policy_version: int = 0, max_policy_version: int = 0,
                    min_reward: float = 0.0, max_reward: float = 0.0,
                    limit: int = 100) -> list[replay_pb2.LineageRecord]:
        """Lineage records by inclusive policy-version range (max 0: open) and reward range (0, 0: any)."""
        req = replay_pb2.QueryRequest(job_id=job_id, min_policy_version=min_policy_version,
                                      max_policy_version=max_policy_version, min_reward=min_reward,
                                      max_reward=max_reward, limit=limit)
        return list((await self._call("Query", req)).records)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> ReplayClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def _call(self, method: str, request: Any, extra_s: float = 0.0, raw: bool = False) -> Any:
        deadline_s = self.timeout_s + extra_s
        metadata = telemetry.grpc_metadata()

        def attempt(stubs: Stubs) -> Awaitable[Any]:
            rpc = stubs.insert_raw if raw else getattr(stubs.replay, method)
            return rpc(request, timeout=deadline_s, metadata=metadata)  # type: ignore[no-any-return]

        return await retry(lambda: self._channel.call(attempt, deadline_s), what=f"replay {method}",
                           policy=self.retry)
