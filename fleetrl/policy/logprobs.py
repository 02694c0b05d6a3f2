"""Log-probabilities and entropies of target tokens under softmax(logits / temperature), in chunks.

The plain form, `naive_token_logprobs` (kept as the definition the tests and `bench.train_step`
compare against), builds log_softmax(logits / temperature), its exp and their product: several
float32 (B, T, vocab) tensors per micro-batch, most of them kept for backward. `token_logprobs` is
one autograd function instead. Its forward takes chunks of CHUNK_POSITIONS targets; per chunk,
log p = log_softmax(logits / temperature) in float32, logprob = log p[target] and, when asked,
entropy = -sum(p * log p). It keeps only the logits (the model's output, alive anyway) and the
per-position entropy. Its backward recomputes the softmax chunk by chunk and writes the logits'
gradient into one buffer:

    d logprob / d z = onehot(target) - p
    d entropy / d z = -p * (log p + entropy)
    d / d logits    = (d / d z) / temperature

With `rows` (shared prompts, `batch.PackedRows`), target i reads logits row rows[i], gathered per
chunk, and the backward adds each target's gradient into its row: the logits are never copied into
a per-target (B, T, vocab) tensor.

Design choice: the entropy is a metric unless `entropy_coef` > 0, so callers ask for it only when
they report or train on it, and it is differentiable only when asked (`entropy_grad`); otherwise
the backward skips its term.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

CHUNK_POSITIONS = 256
"""Positions per chunk: the largest temporary is CHUNK_POSITIONS x vocab float32 (48 MiB for SmolLM2)."""


def naive_token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(log-probs (B, T), entropy (B, T)) of targets (B, T) under softmax(logits (B, T, V) / temperature),
    through full-vocabulary log_softmax: the definition `token_logprobs` must match."""
    upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
    logp_all = torch.log_softmax(upcast / temperature, dim=-1)  # (B, T, V)
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, *, entropy: bool = False, entropy_grad: bool = False,
    rows: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(log-probs (B, T), entropy (B, T) or None) of targets (B, T) under softmax(logits (B, T, V) / temperature),
    or, with `rows` (B, T), under softmax(logits[rows] / temperature) for logits (N, V) (rows may repeat:
    a shared prompt's last position predicts the first token of every completion after it).

    Log-probs are float32 and differentiable with respect to logits. The entropy is computed when
    `entropy` is set, and differentiable only when `entropy_grad` is set too.
    """
    shape = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V), a view of the model's contiguous output
    flat_rows = None if rows is None else rows.reshape(-1)
    logprobs, ent = _TokenLogprobs.apply(flat_logits, targets.reshape(-1), flat_rows, temperature, entropy,
                                         entropy_grad)
    return logprobs.view(shape), ent.view(shape) if entropy else None


def _chunks(n: int) -> range:
    return range(0, n, CHUNK_POSITIONS)


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """logits / temperature in float32 (a view of float32 logits when temperature is 1)."""
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


class _TokenLogprobs(torch.autograd.Function):
    """logits (N, V), targets (M,), rows (M,) or None (then M = N, row i for target i)
    -> (log-probs (M,), entropy (M,), empty when not asked)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, rows: Tensor | None, temperature: float, entropy: bool,
                entropy_grad: bool) -> tuple[Tensor, Tensor]:
        n = targets.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n if entropy else 0, dtype=torch.float32, device=logits.device)
        for s in _chunks(n):
            chunk = slice(s, s + CHUNK_POSITIONS)
            logp = torch.log_softmax(_scaled(_rows_of(logits, rows, chunk), temperature), dim=-1)  # (C, V)
            logprobs[chunk] = logp.gather(-1, targets[chunk, None]).squeeze(-1)
            if entropy:  # -sum p log p, not lse - sum p z: that difference of two large numbers cancels
                ent[chunk] = -torch.linalg.vecdot(logp.exp(), logp)
        ctx.save_for_backward(logits, targets, rows, ent)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logprobs, ent

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Tensor | None,
                 grad_entropy: Tensor | None) -> tuple[Tensor | None, None, None, None, None, None]:
        logits, targets, rows, ent = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        grad = torch.empty_like(logits) if rows is None else torch.zeros_like(logits)
        scale = 1.0 / ctx.temperature  # d z / d logits
        for s in _chunks(targets.shape[0]):
            chunk = slice(s, s + CHUNK_POSITIONS)
            z = _scaled(_rows_of(logits, rows, chunk), ctx.temperature)
            if grad_entropy is None:
                assert grad_logprobs is not None  # both None returned above
                g_lp = grad_logprobs[chunk, None] * scale
                g = torch.softmax(z, dim=-1).mul_(-g_lp).scatter_add_(-1, targets[chunk, None], g_lp)
            else:
                logp = torch.log_softmax(z, dim=-1)
                p = logp.exp()
                g = logp.add_(ent[chunk, None]).mul_(p).mul_(-scale * grad_entropy[chunk, None])
                if grad_logprobs is not None:
                    g_lp = grad_logprobs[chunk, None] * scale
                    g.sub_(p.mul_(g_lp)).scatter_add_(-1, targets[chunk, None], g_lp)
            if rows is None:
                grad[chunk] = g
            else:  # a row read by several targets gets the sum of their gradients
                grad.index_add_(0, rows[chunk], g.to(grad.dtype))
        return grad, None, None, None, None, None


def _rows_of(logits: Tensor, rows: Tensor | None, chunk: slice) -> Tensor:
    """The logits rows of a chunk of targets: a view without `rows`, else a (C, V) gather."""
    return logits[chunk] if rows is None else logits[rows[chunk]]
