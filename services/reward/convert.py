"""Conversions between RewardService protos and the scorer's domain types, in one place.

The callers' side (a job's `RewardSpec` to the wire) is `fleetrl.reward.client.spec_to_proto`.
"""

from __future__ import annotations

import json
from typing import Any

from fleetrl.errors import FieldViolation, InvalidArgument
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2
from fleetrl.reward.scorer import Item, Result, SandboxState, SpecInput, Status, parse_environment, parse_spec
from fleetrl.reward.sessions import Action, EpisodeResult

STATUS_TO_PROTO = {
    Status.OK: common_pb2.REWARD_STATUS_OK,
    Status.ERROR: common_pb2.REWARD_STATUS_ERROR,
    Status.TIMEOUT: common_pb2.REWARD_STATUS_TIMEOUT,
    Status.KILLED: common_pb2.REWARD_STATUS_KILLED,
}


def to_spec(message: reward_pb2.RewardSpec) -> SpecInput:
    """The validated spec of a request (ConfigError naming bad fields)."""
    return parse_spec(message.spec_json, message.file_source)


def to_environment(message: reward_pb2.EnvironmentSpec) -> SpecInput:
    """The validated environment spec of a request (ConfigError naming bad fields)."""
    return parse_environment(message.spec_json, message.file_source)


def _metadata(text: str, field: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidArgument("bad metadata", [FieldViolation(field, str(error))]) from None
    if not isinstance(value, dict):
        raise InvalidArgument("bad metadata", [FieldViolation(field, "not a JSON object")])
    return value


def to_items(request: reward_pb2.ScoreRequest) -> list[Item]:
    """The request's items with their metadata decoded."""
    return [Item(it.completion, it.prompt, _metadata(it.metadata_json, f"items[{i}].metadata_json"))
            for i, it in enumerate(request.items)]


def to_task(request: reward_pb2.OpenEpisodesRequest) -> dict[str, Any]:
    """The environment's task: the prompt line (its prompt and its other fields)."""
    return {**_metadata(request.metadata_json, "metadata_json"), "prompt": request.prompt}


def to_actions(request: reward_pb2.StepEpisodesRequest) -> list[Action]:
    """The request's actions, in order."""
    return [Action(a.episode, a.turn, a.text, a.finish_reason, a.prompt_tokens, a.completion_tokens, a.call)
            for a in request.actions]


def episode_to_proto(result: EpisodeResult) -> reward_pb2.EpisodeResult:
    """The wire form of one episode's answer."""
    return reward_pb2.EpisodeResult(
        episode=result.episode, observation=[reward_pb2.Message(role=m["role"], content=m["content"])
                                             for m in result.observation],
        reward=result.reward, done=result.done, status=STATUS_TO_PROTO[result.status], reason=result.reason,
        latency_s=result.latency_s, tools_json=result.tools_json, segment=result.segment,
        max_new_tokens=result.max_new_tokens, answer=result.answer, components=result.components,
        call=result.call, extends=result.extends)


def to_proto(result: Result) -> reward_pb2.ScoreResult:
    """The wire form of one item's result."""
    return reward_pb2.ScoreResult(reward=result.reward, components=result.components,
                                  status=STATUS_TO_PROTO[result.status], reason=result.reason,
                                  latency_s=result.latency_s)


def score_response(results: list[Result]) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(results=[to_proto(r) for r in results])


def sandbox_report(state: SandboxState) -> reward_pb2.SandboxReport:
    return reward_pb2.SandboxReport(mode=state.mode, layers=state.layers, problem=state.problem,
                                    summary=state.describe())
