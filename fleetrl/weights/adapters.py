"""LoRA adapters as published weights: what a LoRA job's learner sends and its actors apply.

Design choices:
- The published tensors are PEFT's own file format (`get_peft_model_state_dict`: the names an
  `adapter_model.safetensors` holds, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`),
  so a published version is an adapter directory's weights, and nothing else travels.
- Actors merge each version into the plain base model they loaded once (`MergedAdapter`): every
  target weight becomes W_base + (alpha / rank) * B @ A, computed from a kept copy of W_base, so
  versions never accumulate rounding and applying B = 0 gives the base back bit for bit. The
  alternative, the model wrapped in PEFT's adapter layers with each version copied into them, applies
  a version faster but makes every generated token slower (their extra small matmuls), and an actor
  spends far more time generating than applying versions (`python -m bench.weights --json` measures
  both; figures in docs/ARCHITECTURE.md). The price of merging is the copy of the target weights
  (with the default targets, most of the model).
- The learner trains through PEFT's layers and the actor samples from the merged weights: the
  same function, rounded differently (`tests/actor/test_job_policy.py` bounds the log-prob gap).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from transformers import PreTrainedModel

from fleetrl.errors import FieldViolation, InvalidArgument
from fleetrl.policy import models
from fleetrl.spec.config import LoraSpec

ADAPTER = "default"
"""PEFT's name for the one adapter fleetrl puts on a model."""


def wrap(model: PreTrainedModel, spec: LoraSpec, seed: int) -> PeftModel:
    """The model with fresh adapters (B = 0: the base's outputs) on `spec.target_modules`, the base frozen.

    A's random initialisation is drawn from `seed` (the job's), not from whatever the process's global
    generator holds, so two runs of a job train the same adapters."""
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=list(spec.target_modules), task_type="CAUSAL_LM")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def adapter_tensors(model: PeftModel, dtype: torch.dtype | str) -> dict[str, torch.Tensor]:
    """CPU copies of the adapters in `dtype`, under PEFT's file names: what a LoRA job publishes.

    Adapters only: with `lm_head` or an embedding among the targets PEFT's own state dict (and so an
    exported adapter directory) would also hold that layer's full base weight."""
    torch_dtype = models.as_dtype(dtype)
    return {name: tensor.detach().to(device="cpu", dtype=torch_dtype, copy=True).contiguous()
            for name, tensor in get_peft_model_state_dict(model, adapter_name=ADAPTER,
                                                          save_embedding_layers=False).items()}


PEFT_PREFIX = "base_model.model."
"""What PEFT's file names put before a module's name in the base model."""


class MergedAdapter:
    """A plain model whose target weights hold W_base + (alpha / rank) * B @ A for the adapters last
    applied (`apply`), W_base kept aside when this is built (on the base as loaded)."""

    scale: float
    rank: int
    _weights: dict[str, torch.Tensor]
    """The target layers' weights, by module name."""
    _bases: dict[str, torch.Tensor]
    """Their base values."""

    def __init__(self, model: torch.nn.Module, spec: LoraSpec) -> None:
        self.scale, self.rank = spec.alpha / spec.rank, spec.rank
        self._weights = {name: module.weight for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear) and targeted(name, spec.target_modules)}
        if not self._weights:
            raise InvalidArgument("LoRA target modules match no linear layer of the model", [FieldViolation(
                "train.lora.target_modules", f"{list(spec.target_modules)} match no torch.nn.Linear")])
        self._bases = {name: weight.detach().clone() for name, weight in self._weights.items()}

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Merge published adapter tensors (`adapter_tensors`' names, every one, nothing else) into the
        target weights; InvalidArgument naming the tensors that do not fit, before anything changes."""
        self._check(tensors)
        with torch.no_grad():
            for name, weight in self._weights.items():  # in place: no (out, in) temporary to allocate
                a = tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"].to(device=weight.device, dtype=weight.dtype)
                b = tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"].to(device=weight.device, dtype=weight.dtype)
                weight.copy_(self._bases[name]).addmm_(b, a, alpha=self.scale)  # (out, in) += (out, r) @ (r, in)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """The published name and shape of every adapter tensor a version must hold."""
        expected: dict[str, tuple[int, ...]] = {}
        for name, weight in self._weights.items():
            out_features, in_features = weight.shape
            expected[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (self.rank, in_features)
            expected[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (out_features, self.rank)
        return expected

    def _check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        violations = adapter_violations(tensors, self.expected_shapes())
        if violations:
            detail = "; ".join(f"{v.field}: {v.description}" for v in violations[:5])
            raise InvalidArgument(f"adapter tensors do not fit the model ({len(violations)} problems): {detail}",
                                  violations)


def adapter_violations(tensors: Mapping[str, torch.Tensor],
                       expected: Mapping[str, tuple[int, ...]]) -> list[FieldViolation]:
    """What keeps a published adapter version from fitting an adapter whose tensors are `expected`
    (name -> shape): every tensor present, nothing else, each of its shape."""
    violations = [FieldViolation(name, "missing") for name in expected if name not in tensors]
    violations += [FieldViolation(name, "not an adapter of the model") for name in tensors if name not in expected]
    violations += [FieldViolation(name, f"shape {tuple(t.shape)} != {tuple(expected[name])}")
                   for name, t in tensors.items() if name in expected and tuple(t.shape) != tuple(expected[name])]
    return violations


def targeted(module_name: str, targets: tuple[str, ...]) -> bool:
    """PEFT's rule for a list of target names: the module's name is one, or ends with "." + one."""
    return any(module_name == t or module_name.endswith(f".{t}") for t in targets)
