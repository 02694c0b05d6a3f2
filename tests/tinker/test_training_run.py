"""`TrainingRun` in one process: datums sharing a prefix are computed packed, the prefix once, with the log-probs
and the gradient of the padded layout (up to float rounding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleetrl.spec.config import LoraSpec
from fleetrl.tinker import training
from fleetrl.tinker.training import TrainingRun
from fleetrl.tinker.types import Datum
from fleetrl.train.batch import pack_prefix_runs, prefix_runs
from tests.tinker.conftest import MODEL

PROMPTS = [list(range(100, 124)), list(range(300, 331))]
"""Two prompts of 24 and 31 tokens, four completions of 6 to 9 tokens each: the shape of a GRPO batch."""


def group_data() -> list[Datum]:
    data = []
    for p, prompt in enumerate(PROMPTS):
        for s in range(4):
            tokens = prompt + [500 + 10 * p + s + k for k in range(6 + s)]
            weights = np.asarray([0.0] * (len(prompt) - 1) + [0.5 - 0.25 * s] * (len(tokens) - len(prompt)) + [0.0],
                                 dtype=np.float32)
            data.append(Datum([*tokens[:-1], 7], {"target_tokens": np.asarray([*tokens[1:], 8], dtype=np.int64),
                                                  "weights": weights}))
    return data


def grads(run: TrainingRun) -> list[torch.Tensor]:
    return [p.grad.clone() for p in run.model.parameters() if p.requires_grad and p.grad is not None]


def test_prefix_runs_group_consecutive_sequences_by_their_shared_start() -> None:
    a, b, c = [1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8]
    assert prefix_runs([a, b, a, c, c], 3) == [(0, 3, 3), (3, 4, 0), (4, 5, 0)]  # [7, 8] shares 2 < 3
    assert prefix_runs([a, a], 3) == [(0, 2, 5)]
    rows = pack_prefix_runs([a, b, c], [(0, 2, 3), (2, 3, 0)])
    assert rows.input_ids.tolist() == [[1, 2, 3, 4, 5, 9], [7, 8, 0, 0, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 0, 0, 0, 0]]
    assert rows.index.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 0], [6, 7, 0, 0, 0]]
    seen = rows.attention_mask[0, 0]
    assert seen[5].tolist() == [True, True, True, False, False, True]  # b's own token: the prefix and itself


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling"])
def test_packed_datums_train_as_padded_ones(loss_fn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    data = group_data()
    if loss_fn == "importance_sampling":
        data = [Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"], "advantages": d.inputs["weights"],
                                 "logprobs": np.full(len(d.tokens), -2.0, dtype=np.float32)}) for d in data]
    packed_calls = []
    real_pack = training.pack_prefix_runs
    monkeypatch.setattr(training, "pack_prefix_runs", lambda *a: packed_calls.append(1) or real_pack(*a))
    lora = LoraSpec(rank=4)
    packed = TrainingRun.create("m:train:0", "t", MODEL, lora, seed=1)
    padded = TrainingRun.create("m:train:1", "t", MODEL, lora, seed=1)
    padded._packing_ratio = None
    ours = packed.forward_backward(data, loss_fn, {}, backward=True)
    theirs = padded.forward_backward(data, loss_fn, {}, backward=True)
    assert packed_calls, "the packed layout was not used"
    for got, want in zip(ours.logprobs, theirs.logprobs, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)
    assert ours.metrics.keys() == theirs.metrics.keys()
    for name in ours.metrics:
        assert ours.metrics[name] == pytest.approx(theirs.metrics[name], rel=1e-4, abs=1e-5)
    for got, want in zip(grads(packed), grads(padded), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6)
