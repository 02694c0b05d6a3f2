"""Async client of the RewardService for actors (Score, episodes) and the gateway (Validate).

The one place a job's `fleetrl.spec.config.RewardSpec` and its reward file become the wire's
`RewardSpec` message (`spec_to_proto`), and its `EnvironmentSpec` and environment file the wire's
`EnvironmentSpec` (`environment_to_proto`). Every call has a deadline. Score is retried as the
caller's `grpcutil.RetryPolicy` says (the actor retries for rpc_retry_s); a failure past it raises
its domain error (Unavailable, ResourceExhausted, NotFound, ...). Episode calls are retried under
`episode_retry`, which must not name NOT_FOUND: a session the service does not know (it restarted)
ends the rollout. Their retries are safe: OpenEpisodes is idempotent on the caller's session id and
StepEpisodes on (episode, turn). CloseEpisodes is tried once (an unclosed session is reaped).
Validate and Describe are tried once: the gateway answers its caller at once, and an unreachable
service is UNAVAILABLE, never an unchecked accept.
Each call carries the caller's trace context as gRPC metadata (W3C traceparent). A call past its
deadline sends the next ones down a new connection (`grpcutil.RenewingChannel`): a half-open connection
to a reward service that went away costs one deadline, not grpc's keepalive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from fleetrl.errors import RETRYABLE_CODES, Unavailable
from fleetrl.proto.fleetrl.v1 import reward_pb2, reward_pb2_grpc
from fleetrl.runtime import telemetry
from fleetrl.runtime.grpcutil import RenewingChannel, RetryPolicy, retry
from fleetrl.spec.config import EnvironmentSpec, RewardSpec

UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED)


@dataclass(frozen=True)
class Validation:
    """The reward service's verdict on a spec: `reason` None when it can score; the sandbox summary."""

    reason: str | None
    sandbox: str = ""


def spec_to_proto(spec: RewardSpec, file_source: bytes = b"") -> reward_pb2.RewardSpec:
    """The wire form of a job's reward spec (file_source: the reward file's contents, if any)."""
    return reward_pb2.RewardSpec(spec_json=spec.model_dump_json(), file_source=file_source)


def environment_to_proto(spec: EnvironmentSpec, file_source: bytes) -> reward_pb2.EnvironmentSpec:
    """The wire form of a job's environment spec with its file's contents."""
    return reward_pb2.EnvironmentSpec(spec_json=spec.model_dump_json(), file_source=file_source)


class RewardClient:
    """One (renewing) channel to a reward service."""

    addr: str
    timeout_s: float
    retry: RetryPolicy
    episode_retry: RetryPolicy

    def __init__(self, addr: str, *, timeout_s: float, retry: RetryPolicy | None = None,
                 episode_retry: RetryPolicy | None = None) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.episode_retry = episode_retry or RetryPolicy(codes=RETRYABLE_CODES)
        self._channel = RenewingChannel(addr, reward_pb2_grpc.RewardServiceStub)

    async def score(self, job_id: str, spec: reward_pb2.RewardSpec, items: Sequence[reward_pb2.ScoreItem],
                    tenant: str = "") -> list[reward_pb2.ScoreResult]:
        """One result per item, in order (spec: from `spec_to_proto`, built once per job)."""
        request = reward_pb2.ScoreRequest(job_id=job_id, spec=spec, items=items, tenant=tenant)
        response = await self._call("Score", request, self.timeout_s, self.retry)
        return list(response.results)

    async def open_episodes(self, job_id: str, session_id: str, spec: reward_pb2.EnvironmentSpec,
                            task: reward_pb2.OpenEpisodesRequest, count: int,
                            timeout_s: float, tenant: str = "") -> list[reward_pb2.EpisodeResult]:
        """The first observations of `count` new episodes of task (its prompt and metadata_json are used)."""
        request = reward_pb2.OpenEpisodesRequest(job_id=job_id, session_id=session_id, spec=spec, prompt=task.prompt,
                                                 metadata_json=task.metadata_json, count=count, tenant=tenant)
        response = await self._call("OpenEpisodes", request, timeout_s, self.episode_retry)
        return list(response.episodes)

    async def step_episodes(self, job_id: str, session_id: str, actions: Sequence[reward_pb2.Action],
                            timeout_s: float) -> list[reward_pb2.EpisodeResult]:
        """One result per action, in order."""
        request = reward_pb2.StepEpisodesRequest(job_id=job_id, session_id=session_id, actions=actions)
        response = await self._call("StepEpisodes", request, timeout_s, self.episode_retry)
        return list(response.results)

    async def close_episodes(self, job_id: str, session_id: str) -> None:
        """Free a session's workers (tried once)."""
        request = reward_pb2.CloseEpisodesRequest(job_id=job_id, session_id=session_id)
        await self._call("CloseEpisodes", request, self.timeout_s, RetryPolicy(attempts=1))

    async def validate(self, spec: RewardSpec | EnvironmentSpec, source: bytes | None) -> Validation:
        """Whether the spec (and file) loads and exposes `reward` (or, an environment, `Env`), else the
        service's reason; and the sandbox it would run in.

        Unavailable when the service cannot answer (unreachable, or failing for another reason)."""
        if isinstance(spec, EnvironmentSpec):
            request = reward_pb2.ValidateRequest(environment=environment_to_proto(spec, source or b""))
            what = "environment file"
        else:
            request = reward_pb2.ValidateRequest(spec=spec_to_proto(spec, source or b""))
            what = "reward file" if spec.file is not None else "reward spec"
        try:
            response = await self._channel.call(
                lambda stub: stub.Validate(request, timeout=self.timeout_s, wait_for_ready=False), self.timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                return Validation(error.details() or f"the reward service rejected the {what}")
            if error.code() in UNREACHABLE:
                raise Unavailable(f"reward service unreachable at {self.addr}, cannot check {what}: "
                                  f"{error.code().name} {error.details()}") from error
            raise Unavailable(f"reward service failed checking the {what}: {error.code().name} "
                              f"{error.details()}") from error
        reason = None if response.ok else (response.reason or f"the reward service rejected the {what}")
        return Validation(reason, response.sandbox.summary)

    async def describe(self) -> reward_pb2.SandboxReport:
        """The sandbox the service runs user code in (one try, within timeout_s)."""
        return await self._call("Describe", reward_pb2.DescribeRequest(), self.timeout_s,
                                RetryPolicy(attempts=1), traced=False)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request: Any, timeout_s: float, policy: RetryPolicy,
                    traced: bool = True) -> Any:
        """stub.method(request) within timeout_s, tried again as policy says."""
        metadata = telemetry.grpc_metadata() if traced else None

        def attempt(stub: reward_pb2_grpc.RewardServiceStub) -> Any:
            return getattr(stub, method)(request, timeout=timeout_s, metadata=metadata)

        return await retry(lambda: self._channel.call(attempt, timeout_s), what=f"reward {method}", policy=policy)
