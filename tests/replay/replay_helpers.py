"""Helpers of the replay tests: group builders, settings, table set-up."""

from __future__ import annotations

from collections.abc import Sequence

from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.replay.client import ReplayClient
from fleetrl.services.replay.config import ReplaySettings
from fleetrl.spec.config import ReplayConfig


def make_group(job: str, task: str, policy_version: int = 0, rewards: Sequence[float] = (0.0, 1.0),
               tokens: int = 4, actor: str = "actor-1") -> common_pb2.Group:
    samples = [common_pb2.Sample(prompt_token_ids=[1, 2], completion_token_ids=list(range(tokens)),
                                 behaviour_logprobs=[-0.5] * tokens, reward=r) for r in rewards]
    lineage = common_pb2.Lineage(actor_id=actor, delivery_attempt=1, trace_id="ab" * 16)
    return common_pb2.Group(job_id=job, task_id=task, policy_version=policy_version, samples=samples,
                            lineage=lineage)


def settings_for(redis_url: str, **overrides: object) -> ReplaySettings:
    return ReplaySettings.model_validate({"listen": "127.0.0.1:0", "redis_url": redis_url,
                                          "reclaim_interval_s": 0.2, "grace_s": 0, **overrides})


async def configure(client: ReplayClient, job: str, **kw: object) -> None:
    await client.configure(job, ReplayConfig.model_validate(kw))
