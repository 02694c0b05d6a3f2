"""A LoRA job's adapter versions against full bf16 snapshots (part of `python -m bench.weights`).

On the model (SmolLM2-135M by default) with rank-`rank` adapters on the default target modules
(`LoraSpec`: attention and MLP projections), alpha = 2 * rank: the learner's side publishes the base's
full bf16 payload (job `bench-lora-full`) and the adapter tensors in bf16 (job `bench-lora`,
`WeightPublisher` with `adapter_of`, as a LoRA learner does) through one WeightStore. Then, timed
`repeats` times (fastest kept), on float32 hf backends as actors build them:

- full_pull_s: `update` of the full snapshot from nothing (pull + sha256 check), the figure a full
  fine-tuning actor pays before it even decodes and loads the weights;
- full_pull_load_s: that plus decoding and `load_weights` into the model (for context);
- adapter_pull_apply_s: `update` of the adapter version plus decoding and `load_adapter`, which merges
  it into the base (`lora_weights.MergedAdapter`): the whole cost of taking a new LoRA version;
  adapter_apply_s: the merge alone;
- layers_pull_apply_s: the alternative the actor does not use, the model wrapped with PEFT's adapter
  layers and each version copied into them (`set_peft_model_state_dict`).

It also times `generate` (8 samples, `gen_tokens` new tokens, ignoring eos) on the plain model (what
a merged adapter samples from) and on the PEFT-wrapped one, alternately, after one warm-up call of
each, the fastest of `repeats` kept: the per-token price of the alternative.
The adapter values are B ~ N(0, 0.01) (A as PEFT initialises it), not trained ones: bytes and times
of dense adapters do not depend on their values.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import torch
from peft import PeftModel
from peft.utils import set_peft_model_state_dict

from fleetrl.policy import models
from fleetrl.policy.backends import HFBackend, make_backend
from fleetrl.spec.config import LoraSpec
from fleetrl.tasks import bus
from fleetrl.weights import adapters as lora_weights
from fleetrl.weights.channel import decode_safetensors, encode_safetensors
from fleetrl.weights.publish import WeightPublisher
from fleetrl.weights.store import WeightStore


async def _fastest(repeats: int, run: Callable[[], Awaitable[Any]]) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        await run()
        best = min(best, time.perf_counter() - started)
    return best


def _learner_side(model_name: str, spec: LoraSpec) -> PeftModel:
    wrapped = lora_weights.wrap(models.load(model_name)[0], spec, seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    return wrapped


def _tokens_per_s(backend: HFBackend, prompt: list[int], gen_tokens: int) -> float:
    started = time.perf_counter()
    backend.generate(prompt, 8, max_new_tokens=gen_tokens, temperature=1.0, top_p=1.0, seed=0, ignore_eos=True)
    return 8 * gen_tokens / (time.perf_counter() - started)


async def measure_adapters(url: str, model_name: str, rank: int, repeats: int, gen_tokens: int) -> dict[str, Any]:
    spec = LoraSpec(rank=rank, alpha=2 * rank)
    learner = _learner_side(model_name, spec)
    plain = cast(HFBackend, make_backend("hf", model_name, dtype="float32", device="cpu"))
    actor = cast(HFBackend, make_backend("hf", model_name, dtype="float32", device="cpu", lora=spec))
    base, tokenizer = models.load(model_name)
    layers = HFBackend(lora_weights.wrap(base, spec, seed=0), tokenizer)
    full_payload = encode_safetensors(models.state_dict_for_publish(plain.model, "bfloat16"))
    nc = await bus.connect(url, "bench-adapters")
    store = WeightStore(nc, bus.jetstream(nc))
    full = await store.publish("bench-lora-full", 1, full_payload, "bfloat16")
    started = time.perf_counter()
    adapter = await WeightPublisher(store, "bench-lora", "bfloat16", interval=1, keep=2, lease_epoch=0,
                                    adapter_of=model_name).publish(learner, 1)
    adapter_publish_s = time.perf_counter() - started
    assert adapter is not None and adapter.kind == "adapter"
    tensors = decode_safetensors(await store.pull("bench-lora", adapter))

    async def full_pull_load() -> None:
        pulled = await store.update("bench-lora-full", full, None)
        plain.load_weights(decode_safetensors(pulled.payload))

    async def adapter_pull_apply() -> None:
        pulled = await store.update("bench-lora", adapter, None)
        actor.load_adapter(decode_safetensors(pulled.payload))

    async def adapter_apply() -> None:
        actor.load_adapter(tensors)

    async def layers_pull_apply() -> None:
        pulled = await store.update("bench-lora", adapter, None)
        with torch.no_grad():
            set_peft_model_state_dict(cast(PeftModel, layers.model), decode_safetensors(pulled.payload))

    figures: dict[str, Any] = {
        "lora_model": model_name, "lora_rank": rank, "lora_alpha": spec.alpha,
        "lora_target_modules": list(spec.target_modules),
        "lora_full_bytes_per_version": full.size_bytes, "lora_adapter_bytes_per_version": adapter.size_bytes,
        "lora_adapter_publish_s": adapter_publish_s,
        "lora_full_pull_s": await _fastest(repeats, lambda: store.update("bench-lora-full", full, None)),
        "lora_full_pull_load_s": await _fastest(repeats, full_pull_load),
        "lora_adapter_pull_apply_s": await _fastest(repeats, adapter_pull_apply),
        "lora_adapter_apply_s": await _fastest(repeats, adapter_apply),
        "lora_layers_pull_apply_s": await _fastest(repeats, layers_pull_apply),
    }
    await nc.drain()
    prompt, rates = list(range(10, 40)), {"plain": list[float](), "layers": list[float]()}
    for _ in range(repeats + 1):  # alternated, so a change of the machine's load hits both; the first is warm-up
        for name, backend in (("plain", plain), ("layers", layers)):
            rates[name].append(_tokens_per_s(backend, prompt, gen_tokens))
    figures["lora_plain_generate_tokens_s"] = max(rates["plain"][1:])
    figures["lora_layers_generate_tokens_s"] = max(rates["layers"][1:])
    figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    figures["lora_bytes_ratio"] = round(adapter.size_bytes / full.size_bytes, 4)
    figures["lora_pull_apply_speedup"] = round(figures["lora_full_pull_s"] / figures["lora_adapter_pull_apply_s"], 1)
    return figures
