"""A LoRA job's weights: what is published (adapters only) and how an actor merges them."""

from __future__ import annotations

import pytest
import torch

from fleetrl.errors import InvalidArgument
from fleetrl.policy import models
from fleetrl.spec.config import LoraSpec
from fleetrl.weights import adapters as lora_weights


def test_published_tensors_are_adapters_only_even_with_lm_head_targeted() -> None:
    """PEFT's own state dict adds lm_head's full base weight when lm_head is a target; the published one does not."""
    spec = LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "lm_head"))
    tensors = lora_weights.adapter_tensors(lora_weights.wrap(models.load("tiny-llama")[0], spec, seed=0), "bfloat16")
    assert tensors and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors)
    assert {k for k in tensors if "lm_head" in k} == {"base_model.model.lm_head.lora_A.weight",
                                                      "base_model.model.lm_head.lora_B.weight"}


def test_merge_matches_peft_and_bad_tensors_are_named_before_anything_changes() -> None:
    spec = LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "down_proj"))
    learner = lora_weights.wrap(models.load("tiny-llama")[0], spec, seed=0)
    with torch.no_grad():
        for name, param in learner.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.1)
    tensors = lora_weights.adapter_tensors(learner, "float32")
    actor, _ = models.load("tiny-llama")
    merged = lora_weights.MergedAdapter(actor, spec)
    before = models.state_dict_for_publish(actor, "float32")
    wrong = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(InvalidArgument) as error:
        merged.apply({**tensors, wrong: torch.zeros(3, 3)})
    assert [v.field for v in error.value.violations] == [wrong]
    assert all(torch.equal(t, before[n]) for n, t in models.state_dict_for_publish(actor, "float32").items())
    merged.apply(tensors)
    expected = models.state_dict_for_publish(learner.merge_and_unload(), "float32")
    after = models.state_dict_for_publish(actor, "float32")
    assert all(torch.allclose(t, expected[n], atol=1e-6) for n, t in after.items())
    with pytest.raises(InvalidArgument) as error:
        lora_weights.MergedAdapter(actor, LoraSpec(target_modules=("no_such_layer",)))
    assert [v.field for v in error.value.violations] == ["train.lora.target_modules"]
