"""Log-probabilities and entropies of target tokens under softmax(logits / temperature), in chunks.

The plain form, `naive_token_logprobs` (kept as the definition the tests and `bench.train_step`
compare against), builds log_softmax(logits / temperature), its exp and their product: several
float32 (B, T, vocab) tensors per micro-batch, most of them kept for backward. `token_logprobs` is
one autograd function instead. Its forward takes chunks of CHUNK_POSITIONS positions; per chunk,
z = logits / temperature in float32, lse = logsumexp(z), logprob = z[target] - lse and, when asked,
entropy = -sum(p * log p) with log p = z - lse. It keeps only the logits (the model's output, alive anyway)
and the per-position lse and entropy. Its backward recomputes softmax chunk by chunk and writes
the logits' gradient into one buffer:

    d logprob / d z = onehot(target) - p
    d entropy / d z = -p * (log p + entropy)
    d / d logits    = (d / d z) / temperature

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
    logits: Tensor, targets: Tensor, temperature: float = 1.0, *, entropy: bool = False, entropy_grad: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(log-probs (B, T), entropy (B, T) or None) of targets (B, T) under softmax(logits (B, T, V) / temperature).

    Log-probs are float32 and differentiable with respect to logits. The entropy is computed when
    `entropy` is set, and differentiable only when `entropy_grad` is set too.
    """
    shape = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V), a view of the model's contiguous output
    logprobs, ent = _TokenLogprobs.apply(flat_logits, targets.reshape(-1), temperature, entropy, entropy_grad)
    return logprobs.view(shape), ent.view(shape) if entropy else None


def _chunks(n: int) -> range:
    return range(0, n, CHUNK_POSITIONS)


class _TokenLogprobs(torch.autograd.Function):
    """logits (N, V), targets (N,) -> (log-probs (N,), entropy (N,), empty when not asked)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, temperature: float, entropy: bool,
                entropy_grad: bool) -> tuple[Tensor, Tensor]:
        n = logits.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprobs)
        ent = torch.empty(n if entropy else 0, dtype=torch.float32, device=logits.device)
        for s in _chunks(n):
            z = logits[s : s + CHUNK_POSITIONS].float() / temperature  # (C, V), a new buffer
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s : s + CHUNK_POSITIONS] = lse_c
            logprobs[s : s + CHUNK_POSITIONS] = z.gather(-1, targets[s : s + CHUNK_POSITIONS, None]).squeeze(-1) - lse_c
            if entropy:  # -sum p log p, not lse - sum p z: that difference of two large numbers cancels
                logp = z.sub_(lse_c[:, None])
                ent[s : s + CHUNK_POSITIONS] = -torch.linalg.vecdot(logp.exp(), logp)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logprobs, ent

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Tensor | None,
                 grad_entropy: Tensor | None) -> tuple[Tensor | None, None, None, None, None]:
        logits, targets, lse, ent = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None
        grad = torch.empty_like(logits)
        for s in _chunks(logits.shape[0]):
            rows = slice(s, s + CHUNK_POSITIONS)
            logp = logits[rows].float() / ctx.temperature - lse[rows, None]  # (C, V) log p
            p = logp.exp()
            if grad_logprobs is not None:
                g_lp = grad_logprobs[rows, None]
                g = (p * -g_lp).scatter_add_(-1, targets[rows, None], g_lp)
            else:
                g = torch.zeros_like(p)
            if grad_entropy is not None:
                g.sub_(logp.add_(ent[rows, None]).mul_(p).mul_(grad_entropy[rows, None]))
            grad[rows] = g.div_(ctx.temperature)
        return grad, None, None, None, None
