"""The vLLM backend keeps the HF backend's contract (runs only where vLLM and a GPU are installed)."""

from __future__ import annotations

import pytest
import torch

from fleetrl.policy import models, vllm_backend
from fleetrl.policy.backends import prompt_tokens
from fleetrl.spec.config import RolloutConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not vllm_backend.available(), reason="vllm not installed"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM backend needs a CUDA device"),
]


def test_vllm_generates_with_logprobs_and_reloads_weights() -> None:
    backend = vllm_backend.VLLMBackend("tiny-llama", dtype="float32", device="cuda")
    prompt = prompt_tokens(backend.tokenizer, "What is 1 + 2?", RolloutConfig())
    kwargs = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "seed": 3}
    first = backend.generate(prompt, 4, **kwargs)
    assert len(first) == 4 and all(len(c.token_ids) == len(c.logprobs) >= 1 for c in first)
    assert all(lp <= 0.0 for c in first for lp in c.logprobs)
    assert first == backend.generate(prompt, 4, **kwargs)
    model, _ = models.load("tiny-llama")
    tensors = models.state_dict_for_publish(model, "float32")
    backend.load_weights({k: v + 0.05 for k, v in tensors.items()})
    assert [c.token_ids for c in backend.generate(prompt, 4, **kwargs)] != [c.token_ids for c in first]
