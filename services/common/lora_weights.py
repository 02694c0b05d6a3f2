"""LoRA adapters as published weights: what a LoRA job's learner sends and its actors apply.

Design choices:
- The published tensors are PEFT's own file format (`get_peft_model_state_dict`: the names an
  `adapter_model.safetensors` holds, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`),
  so a published version is an adapter directory's weights, and nothing else travels.
- Actors apply an adapter to the base they loaded once by wrapping it with the same PEFT layers the
  learner trains (`wrap`) and copying each version's tensors into them (`load_adapter`), not by
  merging W_base + scale * B @ A into the base weights: the copy is a few MB whatever the model, where
  a merge rewrites every target weight and needs a second copy of them to start from (the figures and
  their command are in docs/ARCHITECTURE.md). The price is the adapters' extra matmuls per token.
- The learner and the actor run the same PEFT forward on the same base, so their log-probs differ
  only as full-sequence and KV-cache forwards do, plus the adapters' rounding to `train.weights_dtype`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from transformers import PreTrainedModel

from services.common import models
from services.common.config import LoraSpec
from services.common.errors import FieldViolation, InvalidArgument

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
    """CPU copies of the adapters in `dtype`, under PEFT's file names: what a LoRA job publishes."""
    torch_dtype = models.as_dtype(dtype)
    return {name: tensor.detach().to(device="cpu", dtype=torch_dtype, copy=True).contiguous()
            for name, tensor in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}


def load_adapter(model: PeftModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy published adapter tensors (`adapter_tensors`' names) into the model's adapters, in place.

    Every adapter of the model must be given and nothing else (InvalidArgument naming the tensors)."""
    expected = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    violations = [FieldViolation(name, "missing") for name in expected if name not in tensors]
    violations += [FieldViolation(name, "not an adapter of the model") for name in tensors if name not in expected]
    violations += [FieldViolation(name, f"shape {tuple(t.shape)} != model's {tuple(expected[name].shape)}")
                   for name, t in tensors.items() if name in expected and t.shape != expected[name].shape]
    if violations:
        detail = "; ".join(f"{v.field}: {v.description}" for v in violations[:5])
        raise InvalidArgument(f"adapter tensors do not fit the model ({len(violations)} problems): {detail}",
                              violations)
    with torch.no_grad():
        set_peft_model_state_dict(model, dict(tensors), adapter_name=ADAPTER)
