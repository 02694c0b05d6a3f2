"""JobPolicy against a real NATS weight store: no weights, forward-only loads, corrupt objects rejected."""

from __future__ import annotations

import pytest
import torch

from services.actor.backends import HFBackend
from services.actor.job_policy import JobPolicy
from services.common import bus, models
from services.common.weights import WeightPointer, WeightStore, encode_safetensors


def _payload(model: torch.nn.Module, shift: float) -> bytes:
    tensors = models.state_dict_for_publish(model, "bfloat16")
    return encode_safetensors({k: (v + shift).contiguous() for k, v in tensors.items()})


async def test_weights_move_forward_only_and_corrupt_objects_are_rejected(nats_url: str) -> None:
    nc = await bus.connect(nats_url, "policy-test")
    js = bus.jetstream(nc)
    store = WeightStore(nc, js)
    model, tokenizer = models.load("tiny-llama")
    base, shifted = _payload(model, 0.0), _payload(model, 0.5)
    policy = JobPolicy("jp", HFBackend(model, tokenizer), store, pull_attempts=2)
    policy.start()
    try:
        assert not await policy.refresh()  # nothing published: no weights, no tasks
        assert not await policy.ensure(0, 0.3)
        await store.publish("jp", 0, base, "bfloat16")
        assert await policy.ensure(0, 5.0) and policy.version == 0
        good = await store.publish("jp", 1, shifted, "bfloat16")
        assert await policy.ensure(1, 5.0) and policy.version == 1
        norm = model.model.norm.weight.detach().clone()
        assert torch.allclose(norm, torch.full_like(norm, 1.5))  # RMSNorm weights start at 1, shifted by 0.5
        kv = await js.key_value(bus.WEIGHTS_KV)
        await kv.put("jp", WeightPointer(2, good.object_name, "0" * 64, good.size_bytes, good.dtype).to_json())
        assert not await policy.ensure(2, 1.0)  # sha256 mismatch: rejected, re-pulled, rejected again
        assert policy.version == 1 and torch.equal(model.model.norm.weight, norm)
        await kv.put("jp", WeightPointer(0, "v0", good.sha256, good.size_bytes, good.dtype).to_json())
        assert await policy.refresh() and policy.version == 1  # an older pointer never moves us back
        await store.publish("jp", 3, base, "bfloat16")
        assert await policy.ensure(3, 5.0) and policy.version == 3
        assert torch.allclose(model.model.norm.weight, torch.ones_like(norm))
    finally:
        await policy.close()
        await nc.close()


@pytest.mark.parametrize("version", [5])
async def test_watch_announces_new_versions(nats_url: str, version: int) -> None:
    nc = await bus.connect(nats_url, "policy-watch")
    js = bus.jetstream(nc)
    store = WeightStore(nc, js)
    model, tokenizer = models.load("tiny-llama")
    policy = JobPolicy("jw", HFBackend(model, tokenizer), store)
    policy.start()
    try:
        await store.publish("jw", version, _payload(model, 0.0), "bfloat16")
        assert await policy.ensure(version, 5.0) and policy.announced == version == policy.version
    finally:
        await policy.close()
        await nc.close()
