"""One base model, many LoRA jobs, on the HF backend: an actor holds each base once.

`SharedBaseBackend` is an `HFBackend` whose model is a PEFT model shared by every LoRA job on the
same (model, dtype, device) in this process (`_BASES`, counted by users): each job is one named
adapter of it, applied unmerged in the forward, so the base's weights are held once whatever the
number of jobs, and each job adds only its adapter (rank x (in + out) per target layer). Design:

- A generation selects its job's adapter and runs under the base's lock: one generation at a time
  on a base (the actor's generations share its compute threads anyway). Each job keeps its own KV
  cache of earlier turns (`HFBackend._turns`), computed under its own adapter.
- `load_adapter` copies a published version (`fleetrl.weights.adapters.adapter_tensors`' names) into
  the job's adapter in place, under the lock, after checking every tensor against the adapter's
  layers (all of them, nothing else, the right shapes): a bad version changes nothing.
- Unmerged, not merged: `MergedAdapter` writes the adapter into the base's weights, which the other
  jobs read. The learner computes its log-probs through the same unmerged PEFT layers.
- Full fine-tuning jobs keep their own copy (`HFBackend`); `load_weights` is refused here.
- `close` removes the job's adapter; the last user's close drops the base, unless the actor preloaded
  it (`preload`, the actor's `preload_models`): then it stays for the next job on it.
"""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fleetrl.errors import FailedPrecondition, InvalidArgument
from fleetrl.policy.backends import Completion, GroupRequest, HFBackend
from fleetrl.spec.config import LoraSpec
from fleetrl.weights.adapters import adapter_violations

BaseKey = tuple[str, str, str]
"""(model name, dtype, device): what makes two jobs' bases the same."""


@dataclass
class _Base:
    """A base model shared by the LoRA jobs on it (a PeftModel once the first adapter is added)."""

    key: BaseKey
    model: Any
    tokenizer: Any
    lock: threading.Lock
    users: int = 0
    """The jobs on it, plus one while it is pinned."""
    pinned: bool = False
    """Preloaded (`preload`): kept when its last job closes."""


_BASES: dict[BaseKey, _Base] = {}
_BASES_LOCK = threading.Lock()


def adapter_name(job_id: str) -> str:
    """A job id as a PEFT adapter name (a module-dict key: no dots)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", job_id) or "job"


def preload(model_name: str, *, dtype: str, device: str) -> BaseKey:
    """Load the base of (model, dtype, device) now and keep it for this process's life (an actor's
    `preload_models`): a LoRA job on it then starts without loading the model. Idempotent."""
    from fleetrl.policy import models

    key = (model_name, dtype, device)
    with _BASES_LOCK:
        base = _BASES.get(key)
        if base is None:
            model, tokenizer = models.load(model_name, dtype=dtype, device=device)
            base = _BASES[key] = _Base(key, model, tokenizer, threading.Lock())
        if not base.pinned:
            base.pinned, base.users = True, base.users + 1  # the process's own use: the base outlives its jobs
    return key


def unload(model_name: str, *, dtype: str, device: str) -> None:
    """Undo `preload`: the base goes when its last job closes (now, when it has none)."""
    with _BASES_LOCK:
        base = _BASES.get((model_name, dtype, device))
        if base is not None and base.pinned:
            base.pinned, base.users = False, base.users - 1
            if base.users == 0:
                _BASES.pop(base.key, None)


def shared_bases() -> int:
    """How many bases this process holds (for tests and metrics)."""
    return len(_BASES)


def generate_mixed(work: list[tuple[SharedBaseBackend, GroupRequest]]) -> list[list[Completion]]:
    """Several LoRA jobs' groups on one base in one batch, each group through its own job's adapter
    (peft's mixed-adapter batches: every forward gets each row's adapter name, `adapter_names`), each
    drawing from its own seed as in `HFBackend.generate_groups`."""
    base = work[0][0]._base
    if any(backend._base is not base for backend, _ in work):
        raise ValueError("a mixed batch runs on one shared base")
    with base.lock:
        return work[0][0]._decode_groups([request for _, request in work], [backend._name for backend, _ in work])


class SharedBaseBackend(HFBackend):
    """A LoRA job's backend on a base it shares with the other LoRA jobs on it."""

    def __init__(self, model_name: str, *, dtype: str, device: str, lora: LoraSpec, job_id: str) -> None:
        from fleetrl.policy import models

        key, name = (model_name, dtype, device), adapter_name(job_id)
        with _BASES_LOCK:
            base = _BASES.get(key)
            if base is None:
                model, tokenizer = models.load(model_name, dtype=dtype, device=device)
                base = _BASES[key] = _Base(key, model, tokenizer, threading.Lock())
            with base.lock:
                if name in getattr(base.model, "peft_config", {}):
                    raise FailedPrecondition(f"job {job_id} already has an adapter on the shared base {model_name}")
                base.model = _with_adapter(base.model, name, lora)
                base.users += 1
        super().__init__(base.model, base.tokenizer)
        self._cache_arg = _cache_argument(base.model.get_base_model())
        self._base, self._name = base, name

    def mixes_with(self, other: object) -> bool:
        """Whether other is an adapter of this job's base (one `generate_mixed` batch can serve both)."""
        return isinstance(other, SharedBaseBackend) and other._base is self._base

    def generate(self, *args: Any, **kwargs: Any) -> list[Completion]:
        with self._base.lock:
            self._base.model.set_adapter(self._name)
            return super().generate(*args, **kwargs)

    def generate_batch(self, *args: Any, **kwargs: Any) -> list[Completion]:
        with self._base.lock:
            self._base.model.set_adapter(self._name)
            return super().generate_batch(*args, **kwargs)

    def generate_groups(self, requests: list[GroupRequest]) -> list[list[Completion]]:
        with self._base.lock:
            self._base.model.set_adapter(self._name)
            return super().generate_groups(requests)

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        with self._base.lock:
            self._base.model.set_adapter(self._name)
            return super().prompt_logprobs(prompt)

    def load_weights(self, tensors: Mapping[str, Tensor]) -> None:
        raise FailedPrecondition("full weights for a LoRA job on a shared base: it loads adapters only")

    def load_adapter(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy a published adapter version into this job's adapter (checked first, then all of it)."""
        with self._base.lock:
            layers = self._layers()
            violations = adapter_violations(tensors, {name: tuple(w.shape) for name, w in layers.items()})
            if violations:
                raise InvalidArgument("the adapter version does not fit the job's adapter", violations[:20])
            for published, parameter in layers.items():
                parameter.data.copy_(tensors[published].to(device=parameter.device, dtype=parameter.dtype))
            self._turns = None

    def adapter_bytes(self) -> int:
        """What this job's adapter holds on the base (its weights, in the base's dtype)."""
        with self._base.lock:
            return sum(w.numel() * w.element_size() for w in self._layers().values())

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        with self._base.lock:
            return {name: tuple(weight.shape) for name, weight in self._layers().items()}

    def _layers(self) -> dict[str, Any]:
        """This job's adapter weights by their published names (`<module>.lora_A.weight`, `.lora_B.`)."""
        out = {}
        for module_name, module in self._base.model.named_modules():
            for part in ("lora_A", "lora_B"):
                table = getattr(module, part, None)
                if isinstance(table, torch.nn.ModuleDict) and self._name in table:
                    out[f"{module_name}.{part}.weight"] = table[self._name].weight
        return out

    def close(self) -> None:
        super().close()
        base = self._base
        with _BASES_LOCK, base.lock:
            base.users -= 1
            if base.users == 0:
                _BASES.pop(base.key, None)
            elif self._name in base.model.peft_config:
                if len(base.model.peft_config) == 1:  # a preloaded base's last job: PEFT cannot run with none
                    base.model = base.model.unload()  # the plain model again (its LoRA layers taken out)
                else:
                    base.model.delete_adapter(self._name)


def _with_adapter(model: Any, name: str, lora: LoraSpec) -> Any:
    """model (a plain model, or a PeftModel already) with a new adapter `name` for lora's layers."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                        target_modules=list(lora.target_modules))
    if isinstance(model, PeftModel):
        model.add_adapter(name, config)
        return model
    return get_peft_model(model, config, adapter_name=name).eval()


def _cache_argument(model: Any) -> str:
    """The KV cache argument of the base model's forward (`HFBackend._forward`)."""
    return "past_key_values" if "past_key_values" in inspect.signature(model.forward).parameters else "cache"
