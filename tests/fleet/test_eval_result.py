"""EvalResult, the one evaluation result: held-out pass@k's figures, its step metrics and its dict form."""

from __future__ import annotations

import json

import pytest

from fleetrl.eval.passk import summarise
from fleetrl.eval.result import EvalResult
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2

OK, ERROR = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_ERROR


def scored(*rows: tuple[float, int]) -> list[reward_pb2.ScoreResult]:
    return [reward_pb2.ScoreResult(reward=reward, status=status) for reward, status in rows]


def test_summarise_fills_the_core_figures_and_the_step_metrics() -> None:
    # 2 problems: greedy (1.0 ok, 0.0 ok), then 2 samples each (1.0, 1.0 | 1.0 errored, 0.5)
    result = summarise(scored((1.0, OK), (0.0, OK), (1.0, OK), (1.0, OK), (1.0, ERROR), (0.5, OK)), 2, 2, 1.0)
    assert (result.problems, result.samples, result.threshold, result.errors) == (2, 2, 1.0, 1)
    assert result.greedy_pass_at_1 == 0.5 and result.greedy_reward_mean == 0.5
    assert result.sampled_pass_at_1 == pytest.approx((1 + 0) / 2) and result.sampled_pass_at_k == 0.5
    assert result.sampled_reward_mean == pytest.approx(3.5 / 4)
    assert result.metrics() == {"eval_greedy_pass_at_1": 0.5, "eval_reward_mean": 0.5, "eval_errors": 1.0,
                                "eval_pass_at_1": 0.5, "eval_pass_at_k": 0.5}


def test_greedy_only_metrics_take_pass_at_1_from_the_greedy_completions() -> None:
    result = summarise(scored((1.0, OK), (0.0, OK), (1.0, OK), (1.0, OK)), 4, 0, 1.0)
    assert result.sampled_pass_at_1 is None and result.samples == 0
    assert result.metrics("x_") == {"x_greedy_pass_at_1": 0.75, "x_reward_mean": 0.75, "x_errors": 0.0,
                                    "x_pass_at_1": 0.75}


def test_the_dict_form_is_the_fields_in_order_then_the_extras() -> None:
    result = EvalResult(model="m", problems=3, samples=4, sampled_pass_at_1=0.5, sampled_pass_at_k=0.75, wall_s=1.5,
                        extras={"turns_mean": 2.0, "status": {"done": 1.0}})
    as_dict = result.as_dict()
    assert list(as_dict) == ["model", "problems", "samples", "threshold", "greedy_pass_at_1", "greedy_reward_mean",
                             "sampled_pass_at_1", "sampled_pass_at_k", "sampled_reward_mean", "errors", "wall_s",
                             "turns_mean", "status"]
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert result.metrics() == {"eval_errors": 0.0, "eval_pass_at_1": 0.5, "eval_pass_at_k": 0.75}
