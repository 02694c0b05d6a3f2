"""The vLLM backend: the `Backend` contract on vLLM's offline engine (`vllm.LLM`), for GPU actors.

vLLM is an optional extra (`pip install fleetrl[vllm]`) and is imported only when this backend is
built. Each `generate` call is one request with `SamplingParams(n, temperature, top_p, max_tokens,
logprobs=0, seed)`: vLLM batches the n samples and returns the log-prob of each sampled token. The
engine is created with `logprobs_mode="processed_logprobs"` (where the installed vLLM has it), so the
log-probs are of the temperature-scaled distribution the learner scores; with top_p < 1 vLLM's
processed log-probs are renormalised over the nucleus, unlike the HF backend's (documented gap).
Seeds make a task's samples reproducible within vLLM, not bit-identical to the HF backend's.
`generate_batch` (an episode turn) sends one request per prompt in one `generate` call, each with its
own `max_tokens` and seed `seed + i`; vLLM's prefix cache reuses the KV cache of earlier turns.

Weights are reloaded in place on every worker with `collective_rpc` calling the model's own
`load_weights` (the API of vLLM's RLHF examples); older engines without `collective_rpc` are reached
through `llm_engine.model_executor.driver_worker`. LoRA jobs (adapter versions) are refused
(`backends.make_backend`): vLLM's LoRA support is untested on a GPU here. Built-in model names are resolved to HF
directories first: `smollm2-135m` to fleetrl's converted cache, `tiny-*` models exported once.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from fleetrl.errors import FailedPrecondition
from fleetrl.policy import models
from fleetrl.policy.backends import Completion


def _load_on_worker(worker: Any, weights: list[tuple[str, Tensor]]) -> None:
    """Runs inside each vLLM worker: copy the published tensors into the served model."""
    worker.model_runner.model.load_weights(weights=weights)


def model_dir(name: str) -> str:
    """An HF directory (or hub id) vLLM can open for a fleetrl model name."""
    cache = models.default_cache_dir()
    if name == models.SMOLLM2:
        return str(models.ensure_smollm2(cache))
    if name.startswith("tiny-"):
        target = cache / f"{name}-hf"
        if not (target / "config.json").exists():
            models.export(*models.load(name), target)
        return str(target)
    return name


class VLLMBackend:
    """A `vllm.LLM` engine serving one job's policy."""

    llm: Any
    tokenizer: Any

    def __init__(self, model_name: str, *, dtype: str, device: str, gpu_memory_utilization: float = 0.5) -> None:
        vllm = importlib.import_module("vllm")
        self._sampling_params = vllm.SamplingParams
        options: dict[str, Any] = {"dtype": dtype, "gpu_memory_utilization": gpu_memory_utilization,
                                   "enable_prefix_caching": True, "logprobs_mode": "processed_logprobs"}
        if device not in ("cuda", "auto"):
            options["device"] = device
        try:
            self.llm = vllm.LLM(model=model_dir(model_name), **options)
        except TypeError:  # a vLLM without logprobs_mode (or device): its default raw log-probs
            options.pop("logprobs_mode")
            options.pop("device", None)
            self.llm = vllm.LLM(model=model_dir(model_name), **options)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(
        self, prompt_token_ids: list[int], n: int, *, max_new_tokens: int, temperature: float, top_p: float,
        seed: int, ignore_eos: bool = False,
    ) -> list[Completion]:
        params = self._sampling_params(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                       logprobs=0, seed=seed % (2**31), ignore_eos=ignore_eos)
        (request,) = self.llm.generate([{"prompt_token_ids": prompt_token_ids}], params, use_tqdm=False)
        return [self._completion(output) for output in request.outputs]

    def generate_batch(
        self, prompts: list[list[int]], *, max_new_tokens: list[int], temperature: float, top_p: float, seed: int,
    ) -> list[Completion]:
        params = [self._sampling_params(n=1, temperature=temperature, top_p=top_p, max_tokens=budget, logprobs=0,
                                        seed=(seed + i) % (2**31)) for i, budget in enumerate(max_new_tokens)]
        requests = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [self._completion(request.outputs[0]) for request in requests]

    @staticmethod
    def _completion(output: Any) -> Completion:
        tokens = [int(t) for t in output.token_ids]
        logprobs = [float(position[token].logprob) for token, position in zip(tokens, output.logprobs, strict=True)]
        reason = "length" if output.finish_reason == "length" else "eos"
        return Completion(tokens, logprobs, output.text, reason)

    def load_adapter(self, tensors: Mapping[str, Tensor]) -> None:
        raise FailedPrecondition("the vllm backend does not apply LoRA adapters (make_backend refuses LoRA jobs)")

    def load_weights(self, tensors: Mapping[str, Tensor]) -> None:
        weights = list(tensors.items())
        if hasattr(self.llm, "collective_rpc"):
            self.llm.collective_rpc(_load_on_worker, args=(weights,))
        else:
            _load_on_worker(self.llm.llm_engine.model_executor.driver_worker, weights)


def available() -> bool:
    """Whether vLLM can be imported here."""
    try:
        importlib.import_module("vllm")
    except ImportError:
        return False
    return True
