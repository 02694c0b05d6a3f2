"""Chunked token log-probs and entropy against the full-vocabulary log_softmax: values and gradients."""

from __future__ import annotations

import pytest
import torch
from test_losses import random_groups, tiny_model

from fleetrl.policy import logprobs as lp
from fleetrl.policy.logprobs import naive_token_logprobs, token_logprobs
from fleetrl.spec.config import JobSpec
from fleetrl.train.batch import build_batch, completion_logprobs, group_advantages
from fleetrl.train.losses import loss_config_for

B, T, V = 3, 200, 501  # B * T = 600 positions: two full chunks of 256 and a partial one


def random_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 4
    targets = torch.randint(0, V, (B, T), generator=gen)
    weights = torch.randn(2, B, T, generator=gen, dtype=torch.float64)
    return logits, targets, weights[0], weights[1]


def grad_of(logits: torch.Tensor, loss_of: object) -> torch.Tensor:
    leaf = logits.clone().requires_grad_()
    loss_of(leaf).backward()  # type: ignore[operator]
    assert leaf.grad is not None
    return leaf.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_values_and_gradients_match_the_full_log_softmax(temperature: float, entropy_grad: bool) -> None:
    assert B * T > 2 * lp.CHUNK_POSITIONS and (B * T) % lp.CHUNK_POSITIONS  # chunks and a partial chunk
    logits, targets, w_lp, w_ent = random_case(int(temperature * 10) + entropy_grad)
    want_lp, want_ent = naive_token_logprobs(logits, targets, temperature)  # float64 reference
    got_lp, got_ent = token_logprobs(logits.float(), targets, temperature, entropy=True, entropy_grad=entropy_grad)
    assert got_ent is not None and got_lp.dtype == got_ent.dtype == torch.float32
    torch.testing.assert_close(got_lp.double(), want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent.double(), want_ent, atol=1e-5, rtol=1e-5)
    assert got_ent.requires_grad is False  # the input does not require grad here

    def naive_loss(x: torch.Tensor) -> torch.Tensor:
        lp_, ent_ = naive_token_logprobs(x, targets, temperature)
        return (lp_ * w_lp).sum() + ((ent_ * w_ent).sum() if entropy_grad else 0)

    def chunked_loss(x: torch.Tensor) -> torch.Tensor:
        lp_, ent_ = token_logprobs(x, targets, temperature, entropy=True, entropy_grad=entropy_grad)
        assert ent_ is not None and ent_.requires_grad is entropy_grad
        return (lp_ * w_lp.float()).sum() + ((ent_ * w_ent.float()).sum() if entropy_grad else 0)

    want = grad_of(logits, naive_loss)
    got = grad_of(logits.float(), chunked_loss)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_entropy_alone_has_the_full_log_softmax_gradient() -> None:
    logits, targets, _, w_ent = random_case(7)
    want = grad_of(logits, lambda x: (naive_token_logprobs(x, targets, 0.9)[1] * w_ent).sum())

    def entropy_only(x: torch.Tensor) -> torch.Tensor:
        ent = token_logprobs(x, targets, 0.9, entropy=True, entropy_grad=True)[1]
        assert ent is not None
        return (ent * w_ent.float()).sum()

    torch.testing.assert_close(grad_of(logits.float(), entropy_only).double(), want, atol=1e-5, rtol=1e-4)


def test_no_entropy_unless_asked_and_half_precision_logits() -> None:
    logits, targets, _, _ = random_case(3)
    got_lp, got_ent = token_logprobs(logits.bfloat16().requires_grad_(), targets)
    assert got_ent is None and got_lp.dtype == torch.float32 and got_lp.requires_grad
    want = naive_token_logprobs(logits.bfloat16(), targets)[0]  # the same bf16 inputs, upcast inside
    torch.testing.assert_close(got_lp, want, atol=1e-4, rtol=1e-5)
    got_lp.sum().backward()


def test_rows_read_shared_logits_and_add_their_gradients() -> None:
    """With `rows`, targets read (and repeat) rows of (N, V) logits: the same values and gradient as
    the naive form on the gathered copy, whose gradient flows back through the gather."""
    logits, targets, w_lp, w_ent = random_case(5)
    flat = logits.reshape(-1, V)[:150]  # N = 150 rows for B * T = 600 targets: every row read ~4 times
    rows = torch.randint(0, 150, (B, T), generator=torch.Generator().manual_seed(1))

    def naive_loss(x: torch.Tensor) -> torch.Tensor:
        lp_, ent_ = naive_token_logprobs(x[rows], targets, 0.7)
        return (lp_ * w_lp).sum() + (ent_ * w_ent).sum()

    def rows_loss(x: torch.Tensor) -> torch.Tensor:
        lp_, ent_ = token_logprobs(x, targets, 0.7, entropy=True, entropy_grad=True, rows=rows)
        assert ent_ is not None
        return (lp_ * w_lp.float()).sum() + (ent_ * w_ent.float()).sum()

    torch.testing.assert_close(token_logprobs(flat.float(), targets, 0.7, rows=rows)[0].double(),
                               naive_token_logprobs(flat[rows], targets, 0.7)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_of(flat.float(), rows_loss).double(), grad_of(flat, naive_loss), atol=1e-5,
                               rtol=1e-4)


def test_completion_logprobs_score_the_completion_targets_of_a_real_model() -> None:
    """The positions asked of the model line up with the targets: the same as full logits sliced."""
    model, groups = tiny_model(), random_groups(5, behaviour_noise=0.3)
    spec = JobSpec(prompts="p.jsonl", reward={"builtin": "numeric_match"})  # type: ignore[arg-type]
    batch = build_batch(groups, group_advantages(groups, loss_config_for(spec)), pad_id=0)
    got_lp, got_ent = completion_logprobs(model, batch, 0.8, entropy=True)
    full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, L, V)
    want_lp, want_ent = naive_token_logprobs(full[:, batch.start : -1], batch.input_ids[:, batch.start + 1 :], 0.8)
    mask = batch.completion_mask.bool()
    assert got_ent is not None and got_lp.shape == mask.shape
    torch.testing.assert_close(got_lp[mask], want_lp[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent[mask], want_ent[mask], atol=1e-5, rtol=1e-5)
