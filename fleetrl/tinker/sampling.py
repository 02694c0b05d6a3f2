"""Sampling for Tinker sampling clients: the actors' sampler (`HFBackend`) over merged adapter versions.

A sampler version (`SamplerWeights`) is what save_weights_for_sampler captured: a base model name and,
for a trained run, the adapter tensors at that moment. `Samplers` keeps one `HFBackend` per
(base model, LoRA shape), shared by every session and tenant that samples from that base, and merges
a version's adapter into it (`MergedAdapter.apply`, as an actor applies a published LoRA version)
before sampling, unless that version is the one already merged. So a Tinker sample is produced by the
same code, from the same merged weights, as a fleet job's rollout, and its log-probs are the
sampling distribution's (`HFBackend`'s).

Design choice: stop tokens other than the model's end of sequence are applied after generation (the
backend generates to max_tokens and the sequence is cut after the first stop token), which costs
the tokens after it but keeps the backend the actors' own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from fleetrl.policy import models
from fleetrl.policy.backends import Completion, GroupRequest, HFBackend
from fleetrl.spec.config import LoraSpec
from fleetrl.tinker.types import SampleParams, SampleResult, Sequence
from fleetrl.weights.channel import WeightPointer


@dataclass(frozen=True)
class SamplerWeights:
    """One sampler version: a base model, and a trained run's adapter as it was saved (None: the base)."""

    version: str
    """Unique among versions (the sampler path or session that made it)."""
    base_model: str
    lora: LoraSpec | None = None
    tensors: dict[str, torch.Tensor] | None = None
    """The adapter in this process (the local path); None for the base, or when it is in the weight store."""
    job_id: str = ""
    """With `sampling = "fleet"`: the weight-store namespace it was published under (`fleetrl.tinker.fleet`)."""
    pointer: WeightPointer | None = None
    """With `sampling = "fleet"`: its version there (None: the base, no adapter)."""


class Samplers:
    """Sampling backends by (base model, LoRA shape); not thread-safe (the service runs it on one thread)."""

    _backends: dict[tuple[str, str], HFBackend]
    """By (base model, the LoRA spec as JSON, "" for none)."""
    _merged: dict[tuple[str, str], str]
    """The version whose adapter each backend holds merged."""

    def __init__(self) -> None:
        self._backends = {}
        self._merged = {}

    def sample(self, weights: SamplerWeights, params: SampleParams) -> SampleResult:
        """num_samples sequences of the prompt from `weights`, and the prompt's log-probs when asked."""
        return sample_with(self._backend_for(weights), params)

    def _backend_for(self, weights: SamplerWeights) -> HFBackend:
        key = (weights.base_model, weights.lora.model_dump_json() if weights.lora else "")
        backend = self._backends.get(key)
        if backend is None:
            model, tokenizer = models.load(weights.base_model)
            backend = self._backends[key] = HFBackend(model, tokenizer)
            if weights.lora is not None:
                backend.use_adapters(weights.lora)
        if weights.tensors is not None and self._merged.get(key) != weights.version:
            backend.load_adapter(weights.tensors)
            self._merged[key] = weights.version
        return backend


def sample_with(backend: HFBackend, params: SampleParams) -> SampleResult:
    """A sample request on a backend holding the version asked for: here (`Samplers`) or on an actor
    (`fleetrl.tinker.fleet.ActorSampling`, an adapter of the actor's shared base)."""
    seed = params.seed if params.seed is not None else random.getrandbits(62)
    cut_by_us = params.stop_tokens is not None
    completions = backend.generate(params.prompt, params.num_samples, max_new_tokens=params.max_tokens,
                                   temperature=params.temperature, top_p=params.top_p, seed=seed,
                                   ignore_eos=cut_by_us)
    sequences = [_stopped_at(c, params.stop_tokens) if cut_by_us else sequence_of(c) for c in completions]
    prompt_logprobs = backend.prompt_logprobs(params.prompt) if params.prompt_logprobs else None
    return SampleResult(sequences, prompt_logprobs)


def batchable(params: SampleParams) -> bool:
    """Whether a request can be decoded in a batch with others (`generate_groups`): it stops where the model
    does (its own stop tokens need the end of sequence ignored, which a batch does not take)."""
    return params.stop_tokens is None


def group_request(params: SampleParams) -> GroupRequest:
    """A batchable request as one group of a batched decode (its seed given: the fleet draws one per request)."""
    seed = params.seed if params.seed is not None else random.getrandbits(62)
    return GroupRequest(params.prompt, params.num_samples, params.max_tokens, params.temperature, params.top_p, seed)


def sequence_of(completion: Completion) -> Sequence:
    return Sequence(completion.token_ids, completion.logprobs, completion.finish_reason == "eos")


def _stopped_at(completion: Completion, stop_tokens: frozenset[int] | None) -> Sequence:
    """The completion up to and including its first stop token (all of it when none was sampled)."""
    for position, token in enumerate(completion.token_ids):
        if stop_tokens and token in stop_tokens:
            return Sequence(completion.token_ids[: position + 1], completion.logprobs[: position + 1], True)
    return Sequence(completion.token_ids, completion.logprobs, False)
