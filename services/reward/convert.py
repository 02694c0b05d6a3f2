"""Conversions between RewardService protos and the scorer's domain types, in one place.

The callers' side (a job's `RewardSpec` to the wire) is `services.reward.client.spec_to_proto`.
"""

from __future__ import annotations

import json
from typing import Any

from services.common.errors import FieldViolation, InvalidArgument
from services.proto.fleetrl.v1 import common_pb2, reward_pb2
from services.reward.scorer import Item, Result, SandboxState, SpecInput, Status, parse_spec

STATUS_TO_PROTO = {
    Status.OK: common_pb2.REWARD_STATUS_OK,
    Status.ERROR: common_pb2.REWARD_STATUS_ERROR,
    Status.TIMEOUT: common_pb2.REWARD_STATUS_TIMEOUT,
    Status.KILLED: common_pb2.REWARD_STATUS_KILLED,
}


def to_spec(message: reward_pb2.RewardSpec) -> SpecInput:
    """The validated spec of a request (ConfigError naming bad fields)."""
    return parse_spec(message.spec_json, message.file_source)


def _bad_metadata(index: int, why: str) -> InvalidArgument:
    return InvalidArgument("bad item metadata", [FieldViolation(f"items[{index}].metadata_json", why)])


def _metadata(text: str, index: int) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise _bad_metadata(index, str(error)) from None
    if not isinstance(value, dict):
        raise _bad_metadata(index, "not a JSON object")
    return value


def to_items(request: reward_pb2.ScoreRequest) -> list[Item]:
    """The request's items with their metadata decoded."""
    return [Item(it.completion, it.prompt, _metadata(it.metadata_json, i)) for i, it in enumerate(request.items)]


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
