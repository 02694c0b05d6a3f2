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
- A learner training several LoRA jobs on one base at once holds its weights once (`SharedBases`): each
  job's model is its own module tree over the same frozen tensors. Nothing writes a LoRA job's base
  weights (its optimizer holds the adapters, its checkpoints restore the adapters, its merges go to a
  fresh copy), so sharing them changes no job's numbers.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fleetrl.policy import models
from fleetrl.weights.adapters import ADAPTER, wrap

__all__ = ["FrozenBase", "SharedBases", "adapter_state_dict", "load_adapters", "merged_model", "merged_state_dict",
           "wrap"]

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


def tree_over_same_tensors(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of model's module tree whose parameters and buffers are model's own tensors (tied ones stay
    tied): PEFT injects adapters into the copy's modules only, while the weights stay in one place."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


@dataclass
class _Held:
    model: PreTrainedModel
    """The loaded base, never wrapped nor trained: each job wraps a `tree_over_same_tensors` copy."""
    tokenizer: PreTrainedTokenizerBase
    users: int = 0


class SharedBases:
    """The base models of the LoRA jobs one learner trains at once, each loaded once per (model, device).

    `take` gives a job its own module tree over the held base's tensors (and its own tokenizer copy: a
    fast tokenizer is not safe to share across threads); `give_back` drops the base with its last job.
    A base's weights are frozen (`wrap` turns their gradients off for every job at once, which is what
    each job wants), so a job's adapters, gradients and optimizer state are its own."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], _Held] = {}
        self._lock = threading.Lock()

    def take(self, name: str, device: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        with self._lock:
            held = self._held.get((name, device))
            if held is None:
                held = self._held[(name, device)] = _Held(*models.load(name, device=device))
            held.users += 1
            return cast(PreTrainedModel, tree_over_same_tensors(held.model)), copy.deepcopy(held.tokenizer)

    def give_back(self, name: str, device: str) -> None:
        with self._lock:
            held = self._held[(name, device)]
            held.users -= 1
            if held.users == 0:
                del self._held[(name, device)]

    def held(self) -> dict[tuple[str, str], int]:
        """The bases held now, with their number of jobs."""
        with self._lock:
            return {key: held.users for key, held in self._held.items()}
