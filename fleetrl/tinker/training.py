"""A Tinker training run: one LoRA adapter on a frozen base model, its AdamW state and its gradients.

`forward_backward` adds the gradient of a chunk's loss to what earlier chunks left; `optim_step`
applies the sum with the step's Adam parameters and clears it, as Tinker's TrainingClient expects
(several forward_backward calls, then one optim_step). The adapters are put on with fleetrl's own
LoRA code (`fleetrl.weights.adapters.wrap`, the learner's), and the log-probs come from the learner's
`token_logprobs`, so a Tinker run trains exactly what a LoRA job would on the same tokens.

Design choices:
- Adam's hyperparameters come with each optim_step (Tinker's contract), so they are written into the
  optimizer's parameter group before each step; its moments persist across steps.
- The runs on one base model share its weights (`fleetrl.policy.lora.SharedBases`, the learner's): each
  run's model is its own module tree, adapters and optimizer over the base's frozen tensors, so ten runs
  on one base hold it once. `close` gives the base back; the last run's close drops it.
- Finite numbers only: a chunk whose loss is not finite applies no gradient and fails with
  InvalidArgument; a step whose gradient norm is not finite zeroes the gradient and is reported as
  skipped (`skipped:sum` 1), so a NaN never reaches the adapter.
- `train_unembed` is accepted and not applied: adapters go on the attention and MLP projections
  only. An adapter on a tied lm_head would also move the input embedding, and the samplers merge
  adapters into linear layers by name (`MergedAdapter`), which a tied weight would break.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from peft import PeftModel

from fleetrl.errors import FieldViolation, InvalidArgument
from fleetrl.policy import models
from fleetrl.policy.logprobs import token_logprobs
from fleetrl.policy.lora import SharedBases, adapter_state_dict, load_adapters
from fleetrl.spec.config import LoraSpec
from fleetrl.tinker.losses import LOSSES, LossBatch
from fleetrl.tinker.types import AdamParams, Datum, ForwardResult, LoraRequest
from fleetrl.train.batch import kernel_mask, pack_prefix_runs, packed_width, packing_pays, prefix_runs
from fleetrl.train.optim import packing_cost_ratio
from fleetrl.weights.adapters import adapter_tensors, wrap

MICRO_BATCH_SEQUENCES = 8
"""Datums per forward/backward pass: bounds the activations and logits a chunk of any size holds at once."""
MIN_SHARED_PREFIX = 8
"""Tokens consecutive datums must share from their start to be packed with the prefix computed once."""
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def lora_spec(request: LoraRequest) -> LoraSpec:
    """The fleetrl LoRA spec of a create_model request (alpha 32, fleetrl's default, at every rank)."""
    targets = (ATTENTION if request.train_attn else ()) + (MLP if request.train_mlp else ())
    if not targets:
        raise InvalidArgument("no layer to train", [FieldViolation(
            "lora_config", "set train_attn or train_mlp (train_unembed alone is not supported)")])
    return LoraSpec(rank=request.rank, target_modules=targets)


@dataclass
class TrainingRun:
    """One TrainingClient's model on the server (its model_id)."""

    model_id: str
    tenant: str
    base_model: str
    lora: LoraSpec
    model: PeftModel
    tokenizer: Any
    optimizer: torch.optim.AdamW
    steps: int = 0
    """optim_steps applied."""
    pending_chunks: int = 0
    """forward_backward chunks whose gradient waits for the next optim_step."""
    bases: SharedBases | None = None
    """Where the base was taken from (given back by `close`); None: the run loaded its own."""
    _packing_ratio: float | None = None
    """The packing cost model's ratio of the model (`train.batch.attention_cost_ratio`); None: never pack."""

    def __post_init__(self) -> None:
        self._packing_ratio = packing_cost_ratio(self.model)

    @classmethod
    def create(cls, model_id: str, tenant: str, base_model: str, lora: LoraSpec, seed: int,
               bases: SharedBases | None = None) -> TrainingRun:
        base, tokenizer = bases.take(base_model, "cpu") if bases is not None else models.load(base_model)
        try:
            model = wrap(base, lora, seed)
        except BaseException:
            if bases is not None:
                bases.give_back(base_model, "cpu")
            raise
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, fused=True)
        return cls(model_id, tenant, base_model, lora, model, tokenizer, optimizer, bases=bases)

    generation = 0
    """A run held here is never restored elsewhere (`fleetrl.tinker.learners.RemoteRun` counts its restores)."""
    restored = ""

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def arch(self) -> str:
        """The base model's class name (the SDK's `get_info`)."""
        return type(self.model.get_base_model()).__name__

    @property
    def tokenizer_id(self) -> str:
        return str(self.tokenizer.name_or_path)

    def own_bytes(self) -> int:
        """Bytes of the run's own tensors: its adapter, their gradients and the optimizer's moments."""
        params = self._params()
        moments = [t for state in list(self.optimizer.state.values()) for t in list(state.values())
                   if isinstance(t, torch.Tensor)]  # list(...) first: the work thread adds them at the first step
        grads = [p.grad for p in params if p.grad is not None]
        return sum(t.numel() * t.element_size() for t in (*params, *grads, *moments))

    def close(self) -> None:
        """Give the shared base back (the run is dropped); idempotent."""
        if self.bases is not None:
            self.bases.give_back(self.base_model, "cpu")
            self.bases = None

    def forward_backward(self, data: list[Datum], loss_fn: str, settings: dict[str, float],
                         backward: bool) -> ForwardResult:
        """The loss of `data` under `loss_fn`; with `backward`, its gradient is added to the run's.

        The datums go through in micro-batches of MICRO_BATCH_SEQUENCES (the loss is a sum, so their
        gradients add up to the chunk's); if any micro-batch's loss is not finite, the gradient is put
        back as it was before the chunk and the chunk fails."""
        before = [None if p.grad is None else p.grad.clone() for p in self._params()] if backward else []
        logprobs: list[np.ndarray] = []
        parts: list[tuple[dict[str, float], float]] = []
        for start in range(0, len(data), MICRO_BATCH_SEQUENCES):
            batch, lengths = self._batch(data[start:start + MICRO_BATCH_SEQUENCES], backward)
            loss, metrics = LOSSES[loss_fn].fn(batch, settings)
            if backward:
                if not math.isfinite(float(loss.detach())):
                    self._restore(before)
                    raise InvalidArgument(f"the {loss_fn} loss of this batch is not finite ({float(loss.detach())}); "
                                          "no gradient was applied", [FieldViolation("data", "non-finite loss")])
                loss.backward()
            values = batch.logprobs.detach().float().numpy()
            logprobs += [values[i, :n].copy() for i, n in enumerate(lengths)]
            parts.append((metrics, float(batch.mask.sum())))
        if backward:
            self.pending_chunks += 1
        return ForwardResult(logprobs, _combined(parts))

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _restore(self, grads: list[torch.Tensor | None]) -> None:
        for param, grad in zip(self._params(), grads, strict=True):
            param.grad = grad

    def _batch(self, data: list[Datum], grad: bool) -> tuple[LossBatch, list[int]]:
        """The micro-batch's log-probs of every target and its loss inputs, (B, T) each. Datums that share a
        prefix (a group's samples of one prompt) are computed packed, the prefix once, when the cost model says
        it is cheaper (`batch.pack_prefix_runs`); else padded."""
        lengths = [len(d.tokens) for d in data]
        width = max(lengths)
        targets = torch.zeros((len(data), width), dtype=torch.long)
        mask = torch.zeros((len(data), width), dtype=torch.float32)
        names = {name for d in data for name in d.inputs if name != "target_tokens"}
        inputs = {name: torch.zeros((len(data), width), dtype=torch.float32) for name in names}
        for i, d in enumerate(data):
            n = lengths[i]
            targets[i, :n] = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))
            mask[i, :n] = 1.0
            for name in names:
                if name in d.inputs:
                    inputs[name][i, :n] = torch.from_numpy(d.inputs[name].astype(np.float32))
        sequences = [d.tokens for d in data]
        runs = prefix_runs(sequences, MIN_SHARED_PREFIX)
        packed = len(runs) < len(data) and packing_pays(
            (len(data), width), (len(runs), packed_width(sequences, runs)), self._packing_ratio)
        self.model.train(grad)
        with torch.set_grad_enabled(grad):
            if packed:
                rows = pack_prefix_runs(sequences, runs)
                logits = self.model(input_ids=rows.input_ids, position_ids=rows.position_ids,
                                    attention_mask=kernel_mask(self.model, rows.attention_mask)).logits  # (R, W, V)
                logprobs, _ = token_logprobs(logits, targets, rows=rows.index)
            else:
                tokens = torch.zeros((len(data), width), dtype=torch.long)  # (B, T)
                for i, d in enumerate(data):
                    tokens[i, :lengths[i]] = torch.tensor(d.tokens)
                logits = self.model(input_ids=tokens, attention_mask=mask.long()).logits  # (B, T, V)
                logprobs, _ = token_logprobs(logits, targets)
        return LossBatch(logprobs, mask, inputs), lengths

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Apply the accumulated gradient with `adam` and clear it; the step's metrics."""
        params = self._params()
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        skipped = not math.isfinite(norm)
        if not skipped:
            self.optimizer.step()
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        chunks, self.pending_chunks = self.pending_chunks, 0
        return {"grad_norm:mean": norm if not skipped else 0.0, "skipped:sum": float(skipped),
                "chunks:sum": float(chunks), "step:max": float(self.steps)}

    def sampler_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter as samplers apply it (PEFT's file names, float32 copies)."""
        return adapter_tensors(self.model, torch.float32)

    def state(self, with_optimizer: bool = True) -> dict[str, Any]:
        """What save_state keeps: the adapter, and the optimizer's moments and step count."""
        state: dict[str, Any] = {"adapter": adapter_state_dict(self.model), "steps": self.steps}
        if with_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state(self, state: dict[str, Any], with_optimizer: bool) -> None:
        """Restore a `state()`: the adapter always, the optimizer when asked (else its moments restart)."""
        load_adapters(self.model, state["adapter"])
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_chunks = 0
        if with_optimizer and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.steps = int(state["steps"])
        else:
            self.optimizer.state.clear()


def _combined(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Micro-batch metrics as one chunk's: `:sum` ones added, `:mean` ones weighted by tokens."""
    combined: dict[str, float] = {}
    tokens = sum(weight for _, weight in parts) or 1.0
    for metrics, weight in parts:
        for name, value in metrics.items():
            share = value if name.endswith(":sum") else value * weight / tokens
            combined[name] = combined.get(name, 0.0) + share
    return combined
