"""One base, many LoRA jobs, on the HF backend (`fleetrl.policy.shared_base`).

Two jobs' backends on one tiny model share one base: each samples exactly what a backend of its own
with its adapter merged samples (same tokens, log-probs within the float32 tolerance), one job's
adapter version leaves the other's generations unchanged, a version that does not fit changes
nothing, and the base goes when its last job closes. An actor process's memory for four LoRA jobs on
one base stays close to one job's (the figure is in bench.tenants; here, the bases are counted).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fleetrl.errors import FailedPrecondition, InvalidArgument
from fleetrl.policy import models
from fleetrl.policy.backends import LOGPROB_TOL, GroupRequest, make_backend
from fleetrl.policy.shared_base import generate_mixed, preload, shared_bases, unload
from fleetrl.spec.config import LoraSpec
from fleetrl.weights.adapters import adapter_tensors

MODEL = "tiny-llama"
LORA = LoraSpec(rank=4, alpha=8)


ROUND = [GroupRequest([1, 2, 3, 4], 3, 5, 1.0, 1.0, seed=7), GroupRequest([5, 6, 7], 2, 5, 1.0, 1.0, seed=8)]


def version(seed: int) -> dict[str, torch.Tensor]:
    """A published adapter version with random A and B (a trained-looking adapter, not the zero init)."""
    model, _ = models.load(MODEL)
    peft_model = get_peft_model(model, LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha,
                                                  target_modules=list(LORA.target_modules)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    return adapter_tensors(peft_model, "float32")


def sample(backend: object, seed: int = 1) -> tuple[list[list[int]], list[list[float]]]:
    completions = backend.generate_batch([[1, 2, 3, 4], [5, 6, 7]], max_new_tokens=[6, 6],  # type: ignore[attr-defined]
                                         temperature=1.0, top_p=1.0, seeds=[seed, seed + 1])
    return [c.token_ids for c in completions], [c.logprobs for c in completions]


def close_enough(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(abs(x - y) < LOGPROB_TOL[torch.float32] for row_a, row_b in zip(a, b, strict=True)
               for x, y in zip(row_a, row_b, strict=True))


def test_jobs_share_one_base_and_sample_as_their_own_merged_copies() -> None:
    before = shared_bases()
    first = make_backend("hf", MODEL, dtype="float32", device="cpu", lora=LORA, share_lora_base=True, job_id="j-1")
    second = make_backend("hf", MODEL, dtype="float32", device="cpu", lora=LORA, share_lora_base=True, job_id="j-2")
    merged = make_backend("hf", MODEL, dtype="float32", device="cpu", lora=LORA)
    try:
        assert shared_bases() == before + 1
        v1, v2 = version(1), version(2)
        first.load_adapter(v1)
        second.load_adapter(v2)
        for shared, tensors in ((first, v1), (second, v2)):
            merged.load_adapter(tensors)
            tokens, logprobs = sample(shared)
            own_tokens, own_logprobs = sample(merged)
            assert tokens == own_tokens and close_enough(logprobs, own_logprobs)
            for batch in (ROUND[:1], ROUND):  # an actor's round of one task (one lock, not two) and of two
                assert [[c.token_ids for c in g] for g in shared.generate_groups(batch)] == \
                    [[c.token_ids for c in g] for g in merged.generate_groups(batch)]
        alone = sample(first)
        second.load_adapter(version(3))  # another job's new version
        assert sample(first) == alone
        assert sample(first) != sample(second)

        bad = {name: tensor[:-1] if name.endswith("lora_A.weight") else tensor for name, tensor in v2.items()}
        with pytest.raises(InvalidArgument, match="does not fit"):
            first.load_adapter(bad)
        with pytest.raises(InvalidArgument) as refused:
            first.load_adapter(dict(list(v1.items())[1:]))
        assert [v.description for v in refused.value.violations] == ["missing"]
        assert sample(first) == alone  # nothing of the refused versions was applied
        with pytest.raises(FailedPrecondition, match="adapters only"):
            first.load_weights({})
    finally:
        first.close()
        assert shared_bases() == before + 1
        second.close()
        merged.close()
    assert shared_bases() == before


def test_a_preloaded_base_outlives_its_jobs() -> None:
    """An actor's `preload_models`: the base is loaded before any job and kept when its last job closes;
    the next job on it gets a fresh adapter of its own on the same base."""
    before = shared_bases()
    preload(MODEL, dtype="float32", device="cpu")
    preload(MODEL, dtype="float32", device="cpu")  # idempotent
    assert shared_bases() == before + 1
    first = make_backend("hf", MODEL, dtype="float32", device="cpu", lora=LORA, share_lora_base=True, job_id="p-1")
    first.load_adapter(version(1))
    first.close()
    assert shared_bases() == before + 1  # kept for the next job
    second = make_backend("hf", MODEL, dtype="float32", device="cpu", lora=LORA, share_lora_base=True, job_id="p-2")
    merged = make_backend("hf", MODEL, dtype="float32", device="cpu", lora=LORA)
    try:
        for tensors in (version(2), version(3)):
            second.load_adapter(tensors)
            merged.load_adapter(tensors)
            assert sample(second)[0] == sample(merged)[0]
    finally:
        second.close()
        merged.close()
    assert shared_bases() == before + 1
    unload(MODEL, dtype="float32", device="cpu")
    assert shared_bases() == before


def test_one_batch_mixes_the_adapters_of_jobs_on_one_base() -> None:
    """`generate_mixed`: two jobs' groups in one batch on their shared base, each row through its own job's
    adapter (peft's mixed-adapter batches), give the tokens each job's own batch gives (prompts of one length:
    no padding differs; the log-probs within the float32 bound), and a batch across two bases is refused."""
    first = make_backend("hf", MODEL, dtype="float32", device="cpu", lora=LORA, share_lora_base=True, job_id="m-1")
    second = make_backend("hf", MODEL, dtype="float32", device="cpu", lora=LORA, share_lora_base=True, job_id="m-2")
    other = make_backend("hf", MODEL, dtype="bfloat16", device="cpu", lora=LORA, share_lora_base=True, job_id="m-3")
    try:
        first.load_adapter(version(1))
        second.load_adapter(version(2))
        one = GroupRequest([1, 2, 3, 4], 3, 6, 1.0, 1.0, seed=7)
        two = GroupRequest([5, 6, 7, 8], 2, 6, 1.0, 1.0, seed=8)
        modes: list[bool] = []  # no autograd graph while generating: the adapters' weights require grad
        hook = first.model.register_forward_pre_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
        mixed = generate_mixed([(first, one), (second, two)])
        hook.remove()
        assert modes and all(modes)
        own = [first.generate_groups([one, two])[0], second.generate_groups([one, two])[1]]
        for got, expected in zip(mixed, own, strict=True):
            assert [c.token_ids for c in got] == [c.token_ids for c in expected]
            assert close_enough([c.logprobs for c in got], [c.logprobs for c in expected])
        assert [c.token_ids for c in mixed[1]] != [c.token_ids for c in first.generate_groups([one, two])[1]]
        with pytest.raises(ValueError, match="one shared base"):
            generate_mixed([(first, one), (other, two)])
    finally:
        for backend in (first, second, other):
            backend.close()
