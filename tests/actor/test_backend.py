"""The HF backend: behaviour log-probs match a full forward pass, draws follow the task seed rule.
The fixed backend (a benchmark instrument): fixed latency, deterministic tokens.

The tolerance measured here is the one documented in fleetrl/policy/backends.py (LOGPROB_TOL).
"""

from __future__ import annotations

import importlib.util
import math
import time

import pytest
import torch

from fleetrl.env.tools import tool_schemas
from fleetrl.policy import models
from fleetrl.policy.backends import (
    LOGPROB_TOL,
    NUCLEUS_CANDIDATES,
    FixedBackend,
    GroupRequest,
    HFBackend,
    conversation_tokens,
    make_backend,
    nucleus,
    prompt_tokens,
    resolve_backend,
)
from fleetrl.rollout.memory import job_cost
from fleetrl.rollout.settings import ActorSettings
from fleetrl.spec.config import JobSpec, LoraSpec, RolloutConfig
from fleetrl.spec.seeding import task_id, task_seed
from fleetrl.train import reference

ROLLOUT = RolloutConfig(samples_per_prompt=8, max_new_tokens=24, temperature=0.7, top_p=0.9)


def _full_forward_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int],
                           temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_behaviour_logprobs_match_full_forward(dtype: torch.dtype) -> None:
    model, tokenizer = models.load("tiny-llama", dtype=dtype)
    backend = HFBackend(model, tokenizer)
    prompt = prompt_tokens(tokenizer, "What is 12 + 30?", ROLLOUT)
    completions = backend.generate(prompt, 8, max_new_tokens=24, temperature=0.7, top_p=0.9, seed=123)
    assert len(completions) == 8
    worst = 0.0
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) >= 1
        full = _full_forward_logprobs(model, prompt, c.token_ids, 0.7)
        worst = max(worst, float((full - torch.tensor(c.logprobs)).abs().max()))
    print(f"{dtype}: max |actor - full forward| = {worst:.2e}")
    assert worst <= LOGPROB_TOL[dtype]


def test_same_seed_same_group_and_reference_loop_agrees() -> None:
    model, tokenizer = models.load("tiny-llama")
    backend = HFBackend(model, tokenizer)
    prompt = prompt_tokens(tokenizer, "What is 1 + 2?", ROLLOUT)
    kwargs = {"max_new_tokens": 24, "temperature": 0.7, "top_p": 0.9}
    first = backend.generate(prompt, 8, seed=5, **kwargs)
    assert first == backend.generate(prompt, 8, seed=5, **kwargs)
    assert [c.token_ids for c in first] != [c.token_ids for c in backend.generate(prompt, 8, seed=6, **kwargs)]
    spec = reference.JobSpec.model_validate({"prompts": "p.jsonl", "reward": {"builtin": "numeric_match"},
                                              "model": "tiny-llama", "rollout": ROLLOUT.model_dump()})
    row = {"prompt": "What is 1 + 2?", "answer": "3"}
    group = reference.rollout_group(model, tokenizer, spec, row, 0, 1, 0, reference.reward_of(spec))
    # The reference loop samples through the backend under the same seed rule (task_seed of the
    # task id): the same group, token for token and log-prob for log-prob.
    actor = backend.generate(prompt, 8, seed=task_seed(spec.seed, task_id(0, 1)), **kwargs)
    assert [list(s.prompt_token_ids) for s in group.samples] == [prompt] * 8
    assert [(c.token_ids, c.finish_reason) for c in actor] == \
        [(list(s.completion_token_ids), s.finish_reason) for s in group.samples]
    for c, s in zip(actor, group.samples, strict=True):
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(list(s.behaviour_logprobs)), atol=1e-5, rtol=0)


def test_completions_stop_at_eos_or_length() -> None:
    model, tokenizer = models.load("tiny-llama")
    backend = HFBackend(model, tokenizer)
    prompt = prompt_tokens(tokenizer, "hi", ROLLOUT)
    long = backend.generate(prompt, 4, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=1, ignore_eos=True)
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in long)
    backend.eos_ids = {long[0].token_ids[2]}  # same seed, same draws: row 0 now ends at its third token
    for c, free in zip(backend.generate(prompt, 4, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=1), long,
                       strict=True):
        if c.finish_reason == "eos":
            assert c.token_ids[-1] in backend.eos_ids and backend.eos_ids.isdisjoint(c.token_ids[:-1])
            assert c.token_ids == free.token_ids[: len(c.token_ids)]
        else:
            assert c.token_ids == free.token_ids and len(c.token_ids) == 6
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert backend.generate(prompt, 4, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=1)[0].token_ids == \
        long[0].token_ids[: long[0].token_ids.index(long[0].token_ids[2]) + 1]


def test_groups_batched_together_draw_from_their_own_seeds_within_the_logprob_bound() -> None:
    """Several tasks' groups in one `generate_groups` call (an actor's round): each group's rows draw
    from its own seed, so a group's tokens come out the same whatever it is batched with (partners of
    the same prompt length, so no padding moves a draw), each row keeps to its group's budget, and
    every behaviour log-prob agrees with a full forward of the tokens sampled. A prompt longer than the
    others (left padding) keeps the bound."""
    model, tokenizer = models.load("tiny-llama")
    backend = HFBackend(model, tokenizer)
    a, b, c = (prompt_tokens(tokenizer, f"What is {x} + {x}?", ROLLOUT) for x in (11, 22, 33))
    long = prompt_tokens(tokenizer, "What is 44 + 44? Show your working, then the number.", ROLLOUT)
    assert len(a) == len(b) == len(c) < len(long)
    first = GroupRequest(a, 4, 10, 0.7, 0.9, seed=1)
    with_b = backend.generate_groups([first, GroupRequest(b, 3, 6, 1.0, 1.0, seed=2)])
    with_c = backend.generate_groups([first, GroupRequest(c, 5, 6, 1.0, 1.0, seed=99)])  # one generator would shift
    assert [x.token_ids for x in with_b[0]] == [x.token_ids for x in with_c[0]]  # the batch's size rounds log-probs
    assert torch.allclose(torch.tensor([x.logprobs for x in with_b[0]]), torch.tensor([x.logprobs for x in with_c[0]]),
                          atol=1e-4, rtol=0)
    assert [x.token_ids for x in with_b[1]] != [x.token_ids for x in with_c[1]]
    requests = [first, GroupRequest(long, 2, 16, 1.0, 0.95, seed=3), GroupRequest(c, 3, 3, 0.5, 1.0, seed=4)]
    groups = backend.generate_groups(requests)
    assert [len(g) for g in groups] == [4, 2, 3]
    worst = 0.0
    for request, group in zip(requests, groups, strict=True):
        for completion in group:
            assert 1 <= len(completion.token_ids) <= request.max_new_tokens
            assert completion.finish_reason == ("length" if len(completion.token_ids) == request.max_new_tokens
                                                and completion.token_ids[-1] not in backend.eos_ids else "eos")
            full = _full_forward_logprobs(model, request.prompt_token_ids, completion.token_ids, request.temperature)
            worst = max(worst, float((full - torch.tensor(completion.logprobs)).abs().max()))
    print(f"batched groups: max |actor - full forward| = {worst:.2e}")
    assert worst <= LOGPROB_TOL[torch.float32]
    solo = backend.generate_groups([first])  # one group is `generate` itself
    assert solo == [backend.generate(a, 4, max_new_tokens=10, temperature=0.7, top_p=0.9, seed=1)]


def test_prompt_tokens_chat_template_system_prompt_and_left_truncation() -> None:
    tokenizer = models.smollm2_tokenizer()
    plain = prompt_tokens(tokenizer, "Hello there", RolloutConfig(chat_template=False))
    assert plain == tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    chat = prompt_tokens(tokenizer, "Hello there", RolloutConfig(system_prompt="Be brief."))
    text = tokenizer.decode(chat)
    assert "Be brief." in text and "Hello there" in text and text.rstrip().endswith("assistant")
    short = prompt_tokens(tokenizer, "Hello there", RolloutConfig(system_prompt="Be brief.", max_prompt_tokens=5))
    assert short == chat[-5:]


def test_fixed_backend_takes_its_latency_and_repeats_under_a_seed() -> None:
    backend = make_backend("fixed", "tiny-llama", dtype="float32", device="cpu", fixed_latency_s=0.2)
    assert isinstance(backend, FixedBackend)
    prompt = prompt_tokens(backend.tokenizer, "What is 1 + 2?", ROLLOUT)
    started = time.perf_counter()
    first = backend.generate(prompt, 4, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=9)
    assert time.perf_counter() - started >= 0.2
    again = backend.generate(prompt, 4, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=9)
    other = backend.generate(prompt, 4, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=10)
    assert first == again and first != other
    vocab = len(backend.tokenizer)
    for c in first:
        assert len(c.token_ids) == 6 and all(0 <= t < vocab for t in c.token_ids)
        assert c.logprobs == pytest.approx([-math.log(vocab)] * 6) and c.finish_reason == "length"
    backend.load_weights({})
    assert backend.weight_loads == 1


def test_an_environments_tools_reach_a_chat_template_with_a_tool_format() -> None:
    _, tokenizer = models.load("tiny-llama")
    rollout = RolloutConfig(max_new_tokens=4)
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    schemas = tool_schemas([_calc])
    plain = conversation_tokens(tokenizer, messages, rollout)
    assert conversation_tokens(tokenizer, messages, rollout, schemas) == plain  # SmolLM2's template has no tools
    tokenizer.chat_template = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
                               "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    with_tools = tokenizer.decode(conversation_tokens(tokenizer, messages, rollout, schemas))
    assert with_tools.startswith('Tools: [{"type": "function", "function": {"name": "_calc"')
    assert with_tools.endswith("user: What is 6 * 7?\nassistant:")


def _calc(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return expression


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    ranked, order = probs.sort(dim=-1, descending=True)
    return probs.scatter(-1, order, ranked.masked_fill(ranked.cumsum(-1) - ranked > top_p, 0.0))


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_nucleus_keeps_what_a_full_sort_keeps(top_p: float) -> None:
    """The candidates-first nucleus keeps exactly the tokens a sort of the whole vocabulary keeps: on peaked
    rows (the candidates hold the mass), on flat rows (it falls back to the sort) and on a batch of both."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 49152, generator=generator)
    peaked = torch.softmax(logits * 6.0, dim=-1)  # a trained model's: the nucleus is a few hundred tokens
    flat = torch.softmax(logits * 0.5, dim=-1)  # an untrained one's: the nucleus outgrows the candidates
    for probs in (peaked, flat, torch.cat([peaked[:3], flat[:3]])):
        assert torch.equal(nucleus(probs, top_p), _nucleus_by_full_sort(probs, top_p))
    assert int((nucleus(peaked, top_p) > 0).sum(-1).max()) < NUCLEUS_CANDIDATES  # the candidates' path
    assert int((nucleus(flat, top_p) > 0).sum(-1).min()) > NUCLEUS_CANDIDATES  # the sort's


def test_a_batch_row_draws_from_its_own_seed_as_generate_does_alone() -> None:
    """generate_batch's row i draws from seeds[i] exactly as `generate(n=1, seed=seeds[i])` does, so a row's
    tokens do not depend on the rows beside it, their number or their order (an episode's call in a turn
    shared with other episodes and calls); only the padded forward's rounding differs."""
    model, tokenizer = models.load("tiny-llama")
    backend = HFBackend(model, tokenizer)
    rows = [prompt_tokens(tokenizer, f"What is {a} + 7?", ROLLOUT) for a in (1, 4444, 22, 333)]
    seeds = [101, 202, 303, 404]
    alone = [backend.generate(row, 1, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=seed)[0]
             for row, seed in zip(rows, seeds, strict=True)]
    backend._turns = None
    together = backend.generate_batch(rows, max_new_tokens=[12] * 4, temperature=1.0, top_p=0.9, seeds=seeds)
    backend._turns = None
    others = backend.generate_batch(rows[:0:-1], max_new_tokens=[12] * 3, temperature=1.0, top_p=0.9,
                                    seeds=seeds[:0:-1])[::-1]  # rows 1-3, reversed, without row 0
    assert len({tuple(c.token_ids) for c in alone}) == 4  # the seeds draw different completions
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.token_ids for c in others] == [c.token_ids for c in alone[1:]]
    for batched, single in [*zip(together, alone, strict=True), *zip(others, alone[1:], strict=True)]:
        assert max(abs(a - b) for a, b in zip(batched.logprobs, single.logprobs, strict=True)) \
            <= LOGPROB_TOL[torch.float32]
    with pytest.raises(ValueError, match="3 seeds for 4 prompts"):
        backend.generate_batch(rows, max_new_tokens=[12] * 4, temperature=1.0, top_p=0.9, seeds=seeds[:3])


def test_episode_turns_prefill_only_what_they_add_to_the_cached_rows() -> None:
    """generate_batch's turn cache: each call after the first prefills only the tokens a row adds
    (the unfed last action token and the observation), and every behaviour log-prob still matches a
    full forward of the row's whole sequence. Rows have their own budgets (a short row's decoded
    tokens after its budget stay in the cache, masked) and one episode ends after turn 1."""
    model, tokenizer = models.load("tiny-llama")
    cached, fresh = HFBackend(model, tokenizer), HFBackend(model, tokenizer)
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    gen = torch.Generator().manual_seed(0)
    rows = [prompt_tokens(tokenizer, f"What is {a} + 7?", ROLLOUT) for a in (1, 22, 333, 4444)]
    budgets = [3, 10, 6, 10]
    for turn in range(3):
        widths.clear()
        seeds = [turn * 10 + i for i in range(len(rows))]
        got = cached.generate_batch(rows, max_new_tokens=budgets, temperature=0.7, top_p=0.9, seeds=seeds)
        prefill = widths[0]
        fresh._turns = None
        want = fresh.generate_batch(rows, max_new_tokens=budgets, temperature=0.7, top_p=0.9, seeds=seeds)
        assert prefill < max(len(r) for r in rows) if turn else prefill == max(len(r) for r in rows)
        for row, g, w in zip(rows, got, want, strict=True):
            assert g.token_ids == w.token_ids
            full = _full_forward_logprobs(model, row, g.token_ids, 0.7)
            assert float((full - torch.tensor(g.logprobs)).abs().max()) <= LOGPROB_TOL[torch.float32]
        sizes = torch.randint(2, 9, (len(rows),), generator=gen).tolist()
        observations = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in sizes]
        rows = [row + c.token_ids + obs for row, c, obs in zip(rows, got, observations, strict=True)]
        if turn == 0:  # the second episode ends: the next call has three rows
            rows, budgets = [rows[0], *rows[2:]], [budgets[0], *budgets[2:]]
    hook.remove()
    cached.load_weights(dict(model.state_dict()))
    assert cached._turns is None  # a weight load drops the cache: it holds the old policy's keys and values


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm installed: tests/actor/test_vllm.py")
def test_auto_is_hf_where_vllm_is_not_installed() -> None:
    """The actors' default backend: without the vllm package every job gets hf (and its memory cost)."""
    for model, lora in (("tiny-llama", None), ("smollm2-135m", LoraSpec(rank=16))):
        assert resolve_backend("auto", model, "cpu", lora) == "hf"
        assert type(make_backend("auto", "tiny-llama", dtype="float32", device="cpu")) is HFBackend
    spec = JobSpec(prompts="p.jsonl", model="tiny-llama", reward={"builtin": "numeric_match"})
    assert job_cost(spec, ActorSettings(actor_id="a")) == job_cost(spec, ActorSettings(actor_id="a", backend="hf"))
    assert [resolve_backend(kind, "tiny-llama", "cpu") for kind in ("hf", "vllm", "fixed")] == ["hf", "vllm", "fixed"]
