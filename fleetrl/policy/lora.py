"""LoRA training on the learner (`train.lora`): PEFT adapters on a frozen base model.

Design choices:
- `wrap` (`fleetrl/weights/adapters.py`, shared with actors) injects the adapters with PEFT and freezes
  everything else, so `optim.build_optimizer` (AdamW over trainable parameters) holds moments for the
  adapters only.
- The KL reference is the same model with its adapters switched off (`FrozenBase`), not a second
  copy of the weights: the base never changes, so it is the initial policy.
- What leaves the learner for actors is the adapter tensors only (`adapters.adapter_tensors`,
  sent by `publish.WeightPublisher`). The `--merged` export is the merged model: each target weight
  plus (alpha / rank) * B @ A, under the base model's own parameter names (`merged_state_dict`),
  computed without touching the trained model (merging in place and back is not exact in floating point).
- Checkpoints hold the adapters only (`adapter_state_dict`); the base is reloaded from the model name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel

from fleetrl.policy import models
from fleetrl.weights.adapters import ADAPTER, wrap

__all__ = ["FrozenBase", "adapter_state_dict", "load_adapters", "merged_model", "merged_state_dict", "wrap"]

_BASE_LAYER = ".base_layer."


class FrozenBase(torch.nn.Module):
    """The wrapped model's forward with its adapters disabled: the frozen reference policy."""

    _wrapped: tuple[PeftModel]

    def __init__(self, model: PeftModel) -> None:
        super().__init__()
        self._wrapped = (model,)  # a tuple, so the model is not registered as this module's child

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._wrapped[0]
        with model.disable_adapter():
            return model(*args, **kwargs)


def merged_state_dict(model: PeftModel, dtype: torch.dtype | str) -> dict[str, torch.Tensor]:
    """The merged weights in `dtype`, named and de-duplicated as `models.state_dict_for_publish`
    names the base model's: what a full fine-tune of the same model would publish."""
    base = model.get_base_model()
    deltas = {f"{name}.weight": cast(Any, module).get_delta_weight(ADAPTER)  # every LoRA layer kind has it
              for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    torch_dtype = models.as_dtype(dtype)
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in models.state_dict_for_publish(base, torch.float32).items():
        if ".lora_" in name:
            continue
        name = name.replace(_BASE_LAYER, ".")
        if name in deltas:
            tensor = tensor + deltas[name].detach().to(device="cpu", dtype=torch.float32)
        merged[name] = tensor.to(torch_dtype).contiguous()
    return merged


def merged_model(model: PeftModel, name: str) -> PreTrainedModel:
    """A fresh copy of base model `name` holding the merged weights (the trained model is untouched)."""
    fresh, _ = models.load(name)
    models.load_state_dict_inplace(fresh, merged_state_dict(model, torch.float32))
    return fresh


def adapter_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """CPU float32 copies of the adapters' tensors, by their names in the wrapped model."""
    return {name: p.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
            for name, p in model.named_parameters() if p.requires_grad}


def load_adapters(model: PeftModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy saved adapter tensors into the model's adapters (every one must be given)."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing, unknown = set(params) - set(tensors), set(tensors) - set(params)
    if missing or unknown:
        raise ValueError(f"adapter tensors do not match the model: missing {sorted(missing)[:3]}, "
                         f"unknown {sorted(unknown)[:3]}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
