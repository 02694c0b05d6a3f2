"""Strict configuration models: the JobSpec and the settings every service shares.

Every model forbids unknown keys, documents each field and bounds it, so a
typo or an out-of-range value fails at submission with its dotted path.
Settings load in the order defaults < TOML file < environment (`FLEETRL_...`,
nested keys joined by `__`) < command-line `--set key=value` overrides.
This module imports no torch, so validation and `--help` are instant.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleetrl.errors import ConfigError, FieldViolation

ENV_PREFIX = "FLEETRL_"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class Strict(BaseModel):
    """Base of every config model: unknown keys are errors, values are re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


# --------------------------------------------------------------------------- job spec


class RewardSpec(Strict):
    """How completions are scored: a built-in verifier or a user's Python file."""

    builtin: str | None = None
    """Name of a built-in reward (e.g. `numeric_match`, `math_equiv`, `regex`, `length_penalty`,
    `code_tests`, `weighted_sum`); see fleetrl/reward/verifiers.py."""
    file: str | None = None
    """Path of a Python file defining `reward(completion, prompt, **metadata) -> float | dict`.
    Its contents travel with the submission."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword parameters of the built-in (or passed to the file's function as `params`)."""
    timeout_per_item_s: float = Field(5.0, gt=0, le=600)
    """Wall-clock limit for scoring one completion; past it the item scores as a timeout."""
    memory_limit_mb: int = Field(1024, ge=64, le=65536)
    """Address-space limit of each sandboxed worker scoring this spec (a reward file or a built-in)."""

    @model_validator(mode="after")
    def _exactly_one(self) -> RewardSpec:
        if (self.builtin is None) == (self.file is None):
            raise ValueError("set exactly one of reward.builtin or reward.file")
        return self


class EnvironmentSpec(Strict):
    """A multi-turn environment: a user's Python file defining `class Env`, run only in the reward
    service's sandbox. Each episode is `Env(task, **params)`; `reset()` gives the first user
    message(s) and `step(action)` gives (observation, reward, done) until done, `max_turns` or
    `max_total_tokens`. An episode's return is the sum of its step rewards."""

    file: str = Field(..., min_length=1)
    """Path of the Python file defining `class Env` (`__init__(task, **params)`, `reset() -> str |
    list[dict]`, `step(action) -> (str | list[dict] | None, float, bool)`). Its contents travel
    with the submission."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of `Env(task, **params)`."""
    max_turns: int = Field(4, ge=1, le=1000)
    """Most assistant turns of an episode; an episode still going after them ends as `max_turns`."""
    max_total_tokens: int = Field(1024, ge=2, le=1_048_576)
    """Most tokens of an episode's whole sequence (prompt, every turn and every observation); an
    episode that reaches it ends as `truncated`."""
    step_timeout_s: float = Field(10.0, gt=0, le=600)
    """Wall-clock limit of one `Env(...)` + `reset()` or one `step()` in the sandbox; past it the
    episode ends as an environment error (timeout) and its worker is killed."""
    episode_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """Wall-clock limit of a whole episode, counted by the reward service from its opening; past
    it the episode ends as an environment error (timeout)."""
    memory_limit_mb: int = Field(1024, ge=64, le=65536)
    """Address-space limit of each sandboxed worker running an episode."""
    unfinished_reward: float | None = Field(None, ge=-1e6, le=1e6)
    """The reward of an episode that did not end done (truncated at max_total_tokens, or out of
    max_turns) in place of its turns' sum, e.g. 0 or a negative penalty; None keeps the sum."""

    @model_validator(mode="after")
    def _episode_outlasts_step(self) -> EnvironmentSpec:
        if self.episode_timeout_s < self.step_timeout_s:
            raise ValueError(f"episode_timeout_s ({self.episode_timeout_s:g}) must be >= step_timeout_s "
                             f"({self.step_timeout_s:g})")
        return self


class AlgorithmConfig(Strict):
    """The RL objective. Presets per `name` are applied by the learner's loss registry."""

    name: Literal["grpo", "dr_grpo", "dapo", "ppo", "ppo_rloo", "gspo", "cispo"] = "grpo"
    """grpo: group-normalised advantages, clipped surrogate; dr_grpo: mean-only baseline, no length
    normalisation; dapo: clip-higher, token-level aggregation, and groups whose rewards are all equal
    dropped from the step without replacement (DAPO's dynamic sampling would refill the batch; here
    the step trains on fewer groups); ppo: clipped surrogate with a learned critic (a linear value head
    on the policy's final hidden state, trained with value_coef and value_clip_eps) and token-level GAE
    advantages (gamma, lam); ppo_rloo: clipped surrogate with an RLOO group baseline and no critic (what
    `ppo` meant before the critic existed: a job started under that meaning fails on resume with a
    message naming ppo_rloo); gspo: GRPO advantages with a sequence-level importance ratio (the geometric
    mean of the token ratios) clipped per sequence, default clip 3e-4 / 4e-4 as in the GSPO paper; cispo:
    token-level REINFORCE whose importance weight is clipped and detached, so clipped tokens keep their
    gradient (MiniMax-M1), default weights clipped to [0, 5]."""
    advantage: Literal["grpo", "dr_grpo", "rloo"] | None = None
    """Group advantage estimator; None takes the algorithm's default. ppo's advantages are GAE from its
    critic, so ppo refuses this field."""
    clip_eps: float | None = Field(None, gt=0, le=1)
    """Lower clip range of the importance ratio: ratios below 1 - clip_eps are clipped. None takes the
    algorithm's default: 0.2; gspo 3e-4 (a sequence ratio); cispo 1.0 (no lower clip of the weight)."""
    clip_eps_high: float | None = Field(None, gt=0, le=10)
    """Upper clip range (DAPO clip-higher); None takes the algorithm's default: clip_eps; dapo 0.28;
    gspo 4e-4; cispo 4.0."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] | None = None
    """How per-token losses are averaged; None takes the algorithm's default."""
    kl_coef: float = Field(0.0, ge=0, le=10)
    """Weight of the KL penalty to the frozen reference model (0 disables the reference)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of KL(policy || reference) per token (Schulman's k1/k2/k3)."""
    entropy_coef: float = Field(0.0, ge=0, le=1)
    """Weight of the entropy bonus."""
    tis_cap: float = Field(2.0, ge=1, le=100)
    """Truncated importance-sampling cap on the ratio between the learner's old policy and the
    actor's behaviour policy, correcting stale or mismatched samples."""
    skip_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (they carry no GRPO signal) from the step, without
    replacing them; a step left with none applies no update. dapo turns it on."""
    gamma: float = Field(1.0, ge=0, le=1)
    """ppo: discount per completion token in GAE (the reward comes at the last token)."""
    lam: float = Field(0.95, ge=0, le=1)
    """ppo: GAE's lambda; 1 gives Monte-Carlo returns minus the value, 0 one-step TD errors."""
    value_coef: float = Field(0.1, gt=0, le=10)
    """ppo: weight of the value loss added to the policy loss (its gradient reaches the shared trunk)."""
    value_clip_eps: float | None = Field(0.2, gt=0, le=100)
    """ppo: the new value is clipped to within value_clip_eps of the step's old value in the value
    loss (the max of the clipped and unclipped squared errors, as PPO2); None: no clipping."""
    value_learning_rate: float | None = Field(None, gt=0, le=1)
    """ppo: peak learning rate of the value head (same schedule as the policy); None:
    optim.learning_rate. A zero-initialised head at a policy's 1e-6 learns slowly; 1e-5 to 1e-4 is usual."""
    normalize_advantages: bool = True
    """ppo: whiten the step's token advantages (subtract their mean, divide by their std) over the real
    completion tokens of the step's trainable groups."""

    @model_validator(mode="after")
    def _ppo_advantages_are_gae(self) -> AlgorithmConfig:
        if self.name == "ppo" and self.advantage is not None:
            raise ValueError(f"algorithm.advantage={self.advantage!r} does not apply to ppo, whose token "
                             "advantages are GAE from its critic (for a group baseline use ppo_rloo)")
        return self


class OptimConfig(Strict):
    """AdamW with warmup then decay, and gradient-norm clipping."""

    learning_rate: float = Field(1e-6, gt=0, le=1)
    """Peak learning rate."""
    warmup_steps: int = Field(0, ge=0, le=1_000_000)
    """Steps of linear warmup from 0 to learning_rate."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warmup, down to min_lr_ratio * learning_rate at max_steps."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak (linear and cosine)."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    max_grad_norm: float = Field(1.0, gt=0, le=1e6)
    """Gradient-norm clipping threshold."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas


class RolloutConfig(Strict):
    """How actors generate completions."""

    prompts_per_step: int = Field(8, ge=1, le=65536)
    """Groups (prompts) per optimizer step."""
    samples_per_prompt: int = Field(8, ge=1, le=1024)
    """Completions per prompt (the GRPO group size)."""
    max_new_tokens: int = Field(128, ge=1, le=131072)
    """Generation stops after this many new tokens."""
    max_prompt_tokens: int = Field(512, ge=1, le=131072)
    """Prompts longer than this (after the chat template) are truncated from the left."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    system_prompt: str | None = None
    """Optional system message placed before each prompt in the chat template."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template (when it has one)."""


class LoraSpec(Strict):
    """Low-rank adapters (PEFT LoRA): the learner trains only these, the base model stays frozen."""

    rank: int = Field(16, ge=1, le=1024)
    """Rank r of each adapter's A (r x in) and B (out x r) matrices."""
    alpha: int = Field(32, ge=1, le=100_000)
    """Scale: the adapter adds (alpha / rank) * B @ A to each target weight."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Names of the linear layers that get an adapter (default: attention and MLP projections)."""

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if not names or not all(re.fullmatch(r"[A-Za-z0-9_.]+", n) for n in names):
            raise ValueError("must be 1 or more module names of letters, digits, '_' and '.'")
        return names


class TrainConfig(Strict):
    """The learner's schedule and its fault-tolerance knobs."""

    max_steps: int = Field(100, ge=1, le=10_000_000)
    """Optimizer steps to run."""
    epochs_per_step: int = Field(1, ge=1, le=64)
    """Passes over each step's batch (PPO-style inner epochs)."""
    micro_batch_samples: int = Field(16, ge=1, le=65536)
    """Sequences per forward/backward pass; gradients accumulate to the full batch."""
    share_prompts: bool = True
    """Compute a prompt that several sequences of a micro-batch share once, with each completion after
    it (a 4D attention mask keeps them apart), wherever a cost model says that is cheaper than one
    padded row per sequence (fleetrl/train/batch.py); false: always one row per sequence. The
    losses are the same up to float rounding."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input during the forward and recompute the layer's activations
    in the backward (transformers' gradient checkpointing, non-reentrant): less peak memory for more
    compute (one more forward of the policy per pass)."""
    max_staleness: int = Field(1, ge=0, le=1000)
    """Most policy versions a trained group may lag the learner (0: strictly on-policy)."""
    publish_interval: int = Field(1, ge=1, le=100_000)
    """Publish weights every this many steps."""
    checkpoint_interval: int = Field(10, ge=1, le=100_000)
    """Write a checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = Field(2, ge=1, le=100)
    """Complete checkpoints kept on disk."""
    keep_weight_versions: int = Field(3, ge=1, le=100)
    """Full weight snapshots kept in the object store (with the deltas after the oldest of them)."""
    full_publish_interval: int = Field(1, ge=1, le=1000)
    """Every this many published versions one is a full snapshot; the others are deltas against the
    version before (a few percent of the bytes; actors keep one more copy of the weights, in
    weights_dtype, to apply them). 1: every version is a full snapshot. Full fine-tuning only: a LoRA
    job publishes its adapters whole every version."""
    weights_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype the learner publishes weights (or a LoRA job's adapters) in (the learner trains in float32;
    each actor casts the pulled weights to its own compute dtype, `ActorSettings.dtype`, float32 by default)."""
    lora: LoraSpec | None = None
    """Train LoRA adapters instead of every weight (a `[train.lora]` table turns it on). The frozen base
    is also the KL reference, so no second model copy is loaded. Each published version is the adapter
    tensors only; actors load the base model once and apply each version's adapters to it (an hf actor
    merges them into the base; a vllm actor serves them as vLLM LoRA adapters)."""
    max_retries_per_episode: int = Field(3, ge=1, le=100)
    """Deliveries of a task before it goes to the dead-letter subject."""
    timeout_per_step_s: float = Field(600.0, gt=0, le=86_400)
    """Longest the learner waits for one step's groups before failing the job."""
    max_nonfinite_steps_in_a_row: int = Field(3, ge=1, le=1000)
    """Steps in a row whose loss or gradient is not finite before the learner fails the job. Each such
    step applies no update and its groups are consumed (fleetrl/train/optim.py)."""
    task_ack_wait_s: float = Field(30.0, ge=1, le=3600)
    """Seconds an actor may hold a task without progress before it is redelivered."""

    @model_validator(mode="after")
    def _fresh_groups_possible(self) -> TrainConfig:
        if self.max_staleness < self.publish_interval - 1:
            raise ValueError(
                f"max_staleness ({self.max_staleness}) must be >= publish_interval - 1 ({self.publish_interval - 1}), "
                "or no group generated with published weights could ever be fresh enough")
        return self

    @model_validator(mode="after")
    def _deltas_of_full_weights(self) -> TrainConfig:
        if self.lora is not None and self.full_publish_interval > 1:
            raise ValueError(f"full_publish_interval ({self.full_publish_interval}) applies to full fine-tuning: a job "
                             "with [train.lora] publishes its adapters whole every version (set it to 1)")
        return self


MAX_CAPACITY_GROUPS = 10_000_000
"""The largest replay table (the replay service enforces the same bounds: `replay.table.TableConfig`)."""
MAX_REUSE = 1000
"""The most times a group may be trained on."""
MAX_LEASE_TIMEOUT_S = 86_400
"""The longest replay lease."""
DEFAULT_LEASE_TIMEOUT_S = 300.0


SamplerName = Literal["fifo", "uniform", "prioritized"]
"""The replay samplers' names (each one is `fleetrl.replay.samplers.SAMPLERS[name]`)."""


class ReplayConfig(Strict):
    """The job's replay table."""

    capacity_groups: int = Field(1024, ge=1, le=MAX_CAPACITY_GROUPS)
    """Groups held at most; the oldest are evicted on overflow."""
    sampler: SamplerName = "fifo"
    """fifo for on-policy training; uniform/prioritized for reuse (`fleetrl.replay.samplers`)."""
    max_reuse: int = Field(1, ge=1, le=MAX_REUSE)
    """Times a group may be trained on (fifo: 1)."""
    lease_timeout_s: float = Field(DEFAULT_LEASE_TIMEOUT_S, gt=0, le=MAX_LEASE_TIMEOUT_S)
    """Seconds before an uncommitted lease returns its groups."""


class EvalConfig(Strict):
    """Held-out evaluation while the job trains: pass@1 and pass@k of the current policy on an eval
    set, scored by the reward service with the job's reward, reported with the step's metrics."""

    prompts: str | None = None
    """Path of the eval prompt JSONL (same format as `prompts`); its contents travel with the submission."""
    interval: int = Field(0, ge=0, le=1_000_000)
    """Evaluate after every `interval` optimizer steps and after the last one (0: never). The learner
    evaluates between steps, so each evaluation adds its time to that step."""
    problems: int = Field(50, ge=1, le=100_000)
    """Evaluate the first this many eval prompts."""
    samples: int = Field(4, ge=0, le=256)
    """k: sampled completions per problem for pass@1 and pass@k (0: greedy only)."""
    threshold: float = 1.0
    """A completion passes when the reward service scores it OK with a reward at least this."""
    max_new_tokens: int | None = Field(None, ge=1, le=131072)
    """Tokens per eval completion (default: rollout.max_new_tokens)."""

    @model_validator(mode="after")
    def _prompts_when_on(self) -> EvalConfig:
        if self.interval > 0 and not self.prompts:
            raise ValueError("eval.interval needs eval.prompts (the eval set's JSONL)")
        return self


class JobSpec(Strict):
    """Everything that defines a training job. Submitted as TOML or JSON."""

    name: str = Field("job", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Human name of the job."""
    model: str = Field("smollm2-135m", min_length=1)
    """Model to train: a built-in name (`smollm2-135m`, `tiny-*` test models), a local HF directory
    (by its absolute path) or a hub id, as the gateway's operator allows (its `allowed_models` and
    `allowed_model_roots`)."""
    prompts: str = Field(..., min_length=1)
    """Path of the prompt JSONL: one object per line with `prompt` and any metadata (e.g. `answer`)."""
    reward: RewardSpec | None = None
    """How completions are scored (single-turn jobs). A job sets `reward`, `environment`, or an
    environment with a built-in verifier (`reward.builtin`) that scores each episode's last action."""
    environment: EnvironmentSpec | None = None
    """A multi-turn environment whose step rewards score the episodes (plus the verifier's score of
    the last action when `reward.builtin` is set beside it)."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed of prompt shuffling, sampling and initialisation."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """The RL objective. Presets per `name` are applied by the learner's loss registry."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """AdamW with warmup then decay, and gradient-norm clipping."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """How actors generate completions."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """The learner's schedule and its fault-tolerance knobs."""
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    """The job's replay table."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out pass@k during training (off unless eval.interval and eval.prompts are set)."""

    @model_validator(mode="after")
    def _reward_or_environment(self) -> JobSpec:
        if self.reward is None and self.environment is None:
            raise ValueError("set one of the tables [reward] (single-turn) or [environment] (multi-turn)")
        if self.environment is not None and self.reward is not None and self.reward.file is not None:
            raise ValueError("beside an [environment], [reward] may name a built-in verifier only (reward.builtin): "
                             "a reward file's logic belongs in the environment's step()")
        if self.train.lora is not None and self.algorithm.name == "ppo":
            raise ValueError("train.lora with algorithm.name = 'ppo' (a critic on the adapters' model) is not "
                             "supported yet: use ppo_rloo, grpo or another critic-free algorithm with LoRA")
        if self.eval.interval > 0 and self.environment is not None:
            raise ValueError("eval.interval scores single-turn completions of the eval set; a job with an "
                             "[environment] plays episodes (measure them with bench.episode_eval)")
        return self


# --------------------------------------------------------------------------- services


def redacted(url: str) -> str:
    """url with the password of its credentials replaced by `***`, for logs and printouts."""
    return re.sub(r"(://[^:/@,]*:)[^@/,]*@", r"\1***@", url)


class InfraSettings(Strict):
    """Where the shared infrastructure is. Every service has these."""

    nats_url: str = DEFAULT_NATS_URL
    """NATS server(s), comma-separated; credentials as `nats://user:password@host:port`."""
    redis_url: str = DEFAULT_REDIS_URL
    """Redis or Valkey URL; a password as `redis://:password@host:port/0`."""
    run_dir: Path = Path("runs/local")
    """Directory for logs, checkpoints, exported models and trace files."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Port of the Prometheus /metrics endpoint (0: none)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level."""


# --------------------------------------------------------------------------- loading

M = TypeVar("M", bound=BaseModel)


def violations_of(error: ValidationError) -> list[FieldViolation]:
    """Every problem of a pydantic error, by dotted path."""
    out = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "<root>"
        out.append(FieldViolation(path, item["msg"]))
    return out


def validate(cls: type[M], data: dict[str, Any], what: str | None = None) -> M:
    """Validate data against cls, raising one ConfigError that lists every bad field."""
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"invalid {what or cls.__name__}", violations_of(error)) from None


MAX_SPEC_DEPTH = 32
"""Deepest nesting of tables and arrays a spec may have; deeper values cannot be stored (pydantic's
JSON serialiser has its own depth limit) or passed to a reward function safely."""


# MAX_SPEC_DEPTH bare or quoted key parts each followed by a dot (so a key of more than MAX_SPEC_DEPTH
# parts), starting where a key can start. The possessive `++` and the look-behind keep the search
# linear in the text's length.
_LONG_DOTTED_KEY = re.compile(
    rf"""(?<![\w."'-])(?:(?:[A-Za-z0-9_-]++|"[^"\n]*+"|'[^'\n]*+')[ \t]*+\.[ \t]*+){{{MAX_SPEC_DEPTH}}}""")


def parse_job_spec(text: str, fmt: Literal["toml", "json"] = "toml") -> JobSpec:
    """Parse and validate a job spec from TOML or JSON text; one ConfigError names every bad field."""
    data = spec_table(text, fmt)
    problems = value_problems(data)
    try:
        spec = validate(JobSpec, data, "job spec")
    except ConfigError as error:
        raise ConfigError("invalid job spec", [*problems, *error.violations]) from None
    if problems:
        raise ConfigError("invalid job spec", problems)
    return spec


def spec_table(text: str, fmt: Literal["toml", "json"] = "toml") -> dict[str, Any]:
    """The table of a spec text; ConfigError at `<root>` when it does not parse or is not a table.

    Besides syntax errors, the parsers raise ValueError for an integer literal of more than 4300
    digits and RecursionError for very deep nesting: both are the user's text, not our fault.
    A TOML dotted key of more than MAX_SPEC_DEPTH parts is refused before parsing: tomllib's time
    grows with the square of a key's parts (a 400 KB `a.a.a...` key takes minutes).
    """
    if fmt == "toml" and _LONG_DOTTED_KEY.search(text):
        raise ConfigError("job spec does not parse", [FieldViolation(
            "<root>", f"a dotted key has more than {MAX_SPEC_DEPTH} parts")])
    try:
        data = tomllib.loads(text) if fmt == "toml" else json.loads(text)
    except ValueError as error:  # TOMLDecodeError and JSONDecodeError are ValueErrors too
        raise ConfigError("job spec does not parse", [FieldViolation("<root>", str(error))]) from None
    except RecursionError:
        raise ConfigError("job spec does not parse", [FieldViolation(
            "<root>", f"nested too deeply (at most {MAX_SPEC_DEPTH} levels are allowed)")]) from None
    if not isinstance(data, dict):
        raise ConfigError("job spec must be a table", [FieldViolation("<root>", "not a table/object")])
    return data


def value_problems(value: Any, root: str = "", max_depth: int | None = MAX_SPEC_DEPTH) -> list[FieldViolation]:
    """Parts of parsed TOML/JSON that no model can hold: nesting deeper than max_depth (None: no
    limit), and strings (or keys) with unpaired surrogates (JSON `\\ud800` escapes), which cannot be
    encoded as UTF-8. Walks without recursion, so it is safe on anything a parser returned; a path
    is spelled out only for a problem found."""
    if isinstance(value, str):
        return [] if _encodable(value) else [FieldViolation(root or "<root>", _NOT_UNICODE)]
    found: list[FieldViolation] = []
    todo: list[tuple[Any, int, _Where]] = [(value, 0, None)] if isinstance(value, dict | list) else []
    while todo:
        item, depth, where = todo.pop()
        if max_depth is not None and depth >= max_depth:
            found.append(FieldViolation(_path(root, where), f"nested deeper than {max_depth} levels"))
            continue
        for key, child in item.items() if isinstance(item, dict) else enumerate(item):
            if isinstance(key, str) and not _encodable(key):
                found.append(FieldViolation(_path(root, where), f"key {key!r} is not valid Unicode"))
            elif isinstance(child, str):
                if not _encodable(child):
                    found.append(FieldViolation(_path(root, (where, key)), _NOT_UNICODE))
            elif child and isinstance(child, dict | list):  # an empty one can hold no problem
                todo.append((child, depth + 1, (where, key)))
    return sorted(found, key=lambda v: v.field)


_NOT_UNICODE = "not valid Unicode (an unpaired surrogate escape)"
_Where = tuple[Any, Any] | None  # (parent's _Where, key): a path kept as links, spelled out on demand


def _path(root: str, where: _Where) -> str:
    keys: list[str] = []
    while where is not None:
        where, key = where
        keys.append(str(key))
    return ".".join([root] * bool(root) + keys[::-1]) or "<root>"


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_value(text: str) -> Any:
    """A `--set` or environment value: JSON/TOML scalar or array if it parses as one, else the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set data["a"]["b"] = value for dotted == "a.b", creating tables on the way."""
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError("bad override", [FieldViolation(dotted, f"{key} is not a table")])
    node[leaf] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides (the CLI's `--set`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("bad override", [FieldViolation(item, "expected key=value")])
        set_dotted(data, key.strip(), parse_value(raw.strip()))
    return data


def env_overrides(prefix: str, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Settings from the environment: FLEETRL_<SERVICE>_<FIELD>, nested keys joined by `__`."""
    environ = dict(os.environ if environ is None else environ)
    data: dict[str, Any] = {}
    for name, raw in environ.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            dotted = name[len(prefix):].lower().replace("__", ".")
            set_dotted(data, dotted, parse_value(raw))
    return data


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_bytes(path: Path, field: str) -> bytes:
    """A file named by a setting or argument; ConfigError naming field and the file if it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read {path}",
                          [FieldViolation(field, f"{path}: {error.strerror or error}")]) from None


def read_toml(path: Path, field: str) -> dict[str, Any]:
    """A TOML file's table; ConfigError naming field and the file if it cannot be read or parsed."""
    try:
        return tomllib.loads(read_bytes(path, field).decode())
    except (ValueError, RecursionError) as error:  # TOMLDecodeError, UnicodeDecodeError, a huge integer
        raise ConfigError(f"{path} does not parse", [FieldViolation(field, f"{path}: {error}")]) from None


def load_settings(
    cls: type[M],
    *,
    env_prefix: str,
    toml_path: Path | None = None,
    overrides: list[str] | None = None,
    environ: dict[str, str] | None = None,
) -> M:
    """Build settings from defaults < TOML file < environment < `--set` overrides.

    Environment names are `env_prefix + FIELD` (upper case), e.g. FLEETRL_REPLAY_REDIS_URL for
    `redis_url` with prefix FLEETRL_REPLAY_; nested fields join with `__`. Only fields cls declares
    are read from the environment, so unrelated FLEETRL_ variables of other services are ignored.
    """
    data = read_toml(Path(toml_path), "config") if toml_path is not None else {}
    env = env_overrides(env_prefix, environ)
    data = _merge(data, {k: v for k, v in env.items() if k in cls.model_fields})
    data = apply_overrides(data, overrides or [])
    return validate(cls, data, f"{cls.__name__} settings")
