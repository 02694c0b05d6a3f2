"""Submission checks that need no other service: sizes, the spec, the prompt JSONL (an sft job's
demonstrations), file pairing, and the operator's admission rules (the model's allow-list, the resource caps).

Every problem becomes a FieldViolation and all of them are gathered before anything is raised, so
one round trip shows the user every mistake. Sizes (the spec text, the prompt and reward files) are
checked first and raise at once (RESOURCE_EXHAUSTED): parsing a file that is too large is wasted work.

An sft job's demonstrations are checked line by line (`fleetrl.spec.demonstrations`) and then through the
model's chat template (`fleetrl.policy.chat_mask`: a conversation longer than `sft.max_seq_tokens`, or one the
template cannot split, is named by its line), with the model's tokenizer loaded here on first use and kept
(`Tokenizers`): the first sft submission of a model imports transformers and torch into the gateway (a few
seconds, some 300 MB). A spec's `model = "job:<id>"` arrives resolved (`JobModel`: the gateway looked the
job up for the submitting tenant) and is then that job's exported directory, outside the allow-list's reach.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fleetrl.errors import ConfigError, FailedPrecondition, FieldViolation, NotFound, ResourceExhausted
from fleetrl.policy.chat_mask import tokenize_demonstrations
from fleetrl.policy.models import BUILTIN_MODELS, allow_list_problem, job_reference, load_tokenizer
from fleetrl.services.gateway.config import GatewaySettings, JobCaps, TenantQuota, capped_paths
from fleetrl.spec.config import EnvironmentSpec, JobSpec, RewardSpec, parse_job_spec, spec_table, value_problems
from fleetrl.spec.demonstrations import demonstration_violations, read_demonstrations
from fleetrl.spec.prompts import prompt_violations

MAX_IDEMPOTENCY_KEY = 128
MAX_SPEC_BYTES = 64 << 10  # tomllib is pure Python: a 64 KiB spec parses in ~0.2 s at worst, 1 MiB in ~10 s


@dataclass(frozen=True)
class Submission:
    """What a user sends to create a job."""

    spec_text: str
    spec_format: str
    prompts: bytes
    reward_file: bytes
    idempotency_key: str = ""
    eval_prompts: bytes = b""
    environment_file: bytes = b""


@dataclass(frozen=True)
class Limits:
    """Size limits of a submission, in bytes."""

    max_prompts_bytes: int
    max_reward_file_bytes: int


@dataclass(frozen=True)
class JobModel:
    """A spec's `model = "job:<id>"` as the gateway resolved it for the submitting tenant: the job's exported
    model directory, or why it cannot be used (no such job of the tenant's, not succeeded, no export)."""

    reference: str
    path: str | None
    problem: str | None = None


class Tokenizers:
    """The tokenizers sft submissions are measured with, by model name: loaded on first use and kept (the last
    few), used by one check at a time (a fast tokenizer must not be shared by threads at once)."""

    keep: int
    _loaded: dict[str, Any]
    lock: threading.Lock

    def __init__(self, keep: int = 4) -> None:
        self.keep, self._loaded, self.lock = keep, {}, threading.Lock()

    def get(self, model: str) -> Any:
        """The model's tokenizer; call it holding `lock`."""
        if model not in self._loaded:
            if len(self._loaded) >= self.keep:
                self._loaded.pop(next(iter(self._loaded)))
            self._loaded[model] = load_tokenizer(model)
        return self._loaded[model]


@dataclass(frozen=True)
class Admission:
    """What the operator lets a job ask for: its model (names, and roots of local directories, with the
    run directory guarded) and the cap on each resource size."""

    models: tuple[str, ...] = BUILTIN_MODELS
    model_roots: tuple[Path, ...] = ()
    run_dir: Path | None = None
    caps: JobCaps = field(default_factory=JobCaps)
    quotas: Callable[[str], tuple[TenantQuota, str]] = lambda tenant: (TenantQuota(), "default_tenant_quota")
    """A tenant's weight and quotas, and the setting they come from (`GatewaySettings.quota`)."""
    tokenizers: Tokenizers = field(default_factory=Tokenizers)

    @classmethod
    def of(cls, settings: GatewaySettings) -> Admission:
        return cls(settings.allowed_models, settings.allowed_model_roots, settings.run_dir, settings.job_caps,
                   settings.quota)


@dataclass(frozen=True)
class Checked:
    """Outcome of the local checks: the spec if it parsed, the reward spec to ask the reward
    service about (also when other parts of the spec are bad), the environment spec likewise, and
    every violation found."""

    spec: JobSpec | None
    reward: RewardSpec | None
    violations: list[FieldViolation]
    environment: EnvironmentSpec | None = None


def check_sizes(sub: Submission, limits: Limits) -> None:
    spec_bytes = len(sub.spec_text.encode())
    if spec_bytes > MAX_SPEC_BYTES:
        raise ResourceExhausted(f"spec is {spec_bytes} bytes, more than the limit of {MAX_SPEC_BYTES}")
    for what, data in (("prompt file", sub.prompts), ("eval prompt file", sub.eval_prompts)):
        if len(data) > limits.max_prompts_bytes:
            raise ResourceExhausted(
                f"{what} is {len(data)} bytes, more than the limit of {limits.max_prompts_bytes}")
    for what, data in (("reward file", sub.reward_file), ("environment file", sub.environment_file)):
        if len(data) > limits.max_reward_file_bytes:
            raise ResourceExhausted(f"{what} is {len(data)} bytes, more than the limit of "
                                    f"{limits.max_reward_file_bytes}")


def check_submission(sub: Submission, admission: Admission, job_model: JobModel | None = None) -> Checked:
    """Parse the spec (its `job:` model replaced by `job_model`'s directory), check it against the admission
    rules, and check the prompts (or demonstrations) and the reward file's pairing with the spec."""
    violations: list[FieldViolation] = []
    fmt = _format(sub.spec_format, violations)
    spec, reward = _spec(sub.spec_text, fmt, violations)
    if spec is not None and job_model is not None and spec.model == job_model.reference:
        if job_model.path is None:
            violations.append(FieldViolation("model", job_model.problem or f"{job_model.reference!r} is unknown"))
        else:
            spec = spec.model_copy(update={"model": job_model.path})
    if spec is not None:
        violations += admission_violations(spec, admission, check_model=job_model is None)
    environment = spec.environment if spec is not None else _environment_alone(sub.spec_text, fmt)
    if spec is not None and not spec.rolls_out:
        model_ok = not any(v.field == "model" for v in violations)
        violations += _demonstration_violations(spec, sub.prompts, admission.tokenizers, model_ok=model_ok)
    elif spec is not None or not _sft_alone(sub.spec_text, fmt):
        violations += prompt_violations(sub.prompts)
    else:
        violations += demonstration_violations(sub.prompts)
    if reward is not None:
        violations += _pairing(reward, sub.reward_file)
    elif spec is not None and sub.reward_file:
        violations.append(FieldViolation("reward_file", "a reward file was sent but the spec has no [reward]"))
    violations += _environment_pairing(environment, sub.environment_file)
    violations += _eval_violations(spec, sub.eval_prompts)
    if len(sub.idempotency_key) > MAX_IDEMPOTENCY_KEY:
        violations.append(FieldViolation("idempotency_key", f"longer than {MAX_IDEMPOTENCY_KEY} characters"))
    return Checked(spec, reward, violations, environment)


def job_reference_of(sub: Submission) -> str | None:
    """The spec's model when it is a `job:<id>` reference (read before the spec is checked), else None."""
    try:
        model = spec_table(sub.spec_text, "json" if sub.spec_format == "json" else "toml").get("model")
    except ConfigError:
        return None
    return model if isinstance(model, str) and job_reference(model) is not None else None


def admission_violations(spec: JobSpec, admission: Admission, *, check_model: bool = True) -> list[FieldViolation]:
    """The spec's model if the allow-list refuses it (unless the gateway resolved it from a `job:` reference),
    and every value above its cap."""
    problem = allow_list_problem(spec.model, admission.models, admission.model_roots, admission.run_dir) \
        if check_model else None
    violations = [FieldViolation("model", problem)] if problem is not None else []
    for name, info in JobCaps.model_fields.items():
        cap = getattr(admission.caps, name)
        for path in capped_paths(info):
            value = _value_at(spec, path)
            if value is not None and value > cap:
                violations.append(FieldViolation(path, f"{value} is above the operator's cap of {cap} "
                                                       f"(gateway setting job_caps.{name})"))
    return violations


def _value_at(spec: JobSpec, path: str) -> Any:
    """The spec's value at a dotted path; None where a section on the way is unset."""
    node: Any = spec
    for name in path.split("."):
        node = getattr(node, name) if node is not None else None
    return node


def _format(raw: str, violations: list[FieldViolation]) -> Literal["toml", "json"]:
    if raw in ("", "toml"):
        return "toml"
    if raw == "json":
        return "json"
    violations.append(FieldViolation("spec_format", f"must be 'toml' or 'json', not {raw!r}"))
    return "toml"


def _spec(text: str, fmt: Literal["toml", "json"],
          violations: list[FieldViolation]) -> tuple[JobSpec | None, RewardSpec | None]:
    try:
        spec = parse_job_spec(text, fmt)
        return spec, spec.reward
    except ConfigError as error:
        violations += error.violations
    return None, _reward_alone(text, fmt)


def _reward_alone(text: str, fmt: Literal["toml", "json"]) -> RewardSpec | None:
    """The reward table of a spec that failed elsewhere, if the table itself is valid."""
    try:
        reward = spec_table(text, fmt)["reward"]
        if value_problems(reward):
            return None
        return RewardSpec.model_validate(reward)
    except (ValueError, KeyError, TypeError):  # ConfigError and pydantic's ValidationError are ValueErrors
        return None


def _sft_alone(text: str, fmt: Literal["toml", "json"]) -> bool:
    """Whether a spec that failed elsewhere names the sft algorithm (its prompts are then demonstrations)."""
    try:
        algorithm = spec_table(text, fmt).get("algorithm")
    except ConfigError:
        return False
    return isinstance(algorithm, dict) and algorithm.get("name") == "sft"


def _demonstration_violations(spec: JobSpec, data: bytes, tokenizers: Tokenizers, *,
                              model_ok: bool) -> list[FieldViolation]:
    """Every bad line of an sft job's demonstrations; when every line reads and the model is admitted
    (`model_ok`), also the conversations that its chat template cannot split or that are too long."""
    bad = demonstration_violations(data)
    if bad or not model_ok:
        return bad
    with tokenizers.lock:
        try:
            tokenizer = tokenizers.get(spec.model)
        except (NotFound, FailedPrecondition, OSError, ValueError) as error:
            return [FieldViolation("model", f"its tokenizer, which measures the demonstrations, could not be "
                                            f"loaded: {error}")]
        return tokenize_demonstrations(tokenizer, read_demonstrations(data), spec.sft.max_seq_tokens)[1]


def _environment_alone(text: str, fmt: Literal["toml", "json"]) -> EnvironmentSpec | None:
    """The environment table of a spec that failed elsewhere, if the table itself is valid."""
    try:
        environment = spec_table(text, fmt)["environment"]
        if value_problems(environment):
            return None
        return EnvironmentSpec.model_validate(environment)
    except (ValueError, KeyError, TypeError):  # ConfigError and pydantic's ValidationError are ValueErrors
        return None


def _environment_pairing(environment: EnvironmentSpec | None, source: bytes) -> list[FieldViolation]:
    """An environment file goes with an [environment] table, and only with one (a table that does not
    validate is reported by the spec's own checks)."""
    if environment is not None and not source:
        return [FieldViolation("environment_file", f"the spec names environment.file {environment.file!r} but "
                                                   "no file contents were sent")]
    if environment is None and source:
        return [FieldViolation("environment_file", "an environment file was sent but the spec has no [environment]")]
    return []


def _pairing(reward: RewardSpec, source: bytes) -> list[FieldViolation]:
    if reward.file is not None and not source:
        return [FieldViolation("reward_file", f"the spec names reward.file {reward.file!r} but no file "
                                              "contents were sent")]
    if reward.file is None and source:
        return [FieldViolation("reward_file", "a reward file was sent but the spec uses reward.builtin")]
    return []


def _eval_violations(spec: JobSpec | None, data: bytes) -> list[FieldViolation]:
    """The eval file's pairing with the spec's eval.prompts, and its bad lines."""
    named = spec is not None and spec.eval.prompts is not None
    if spec is not None and not named and data:
        return [FieldViolation("eval_prompts", "an eval prompt file was sent but the spec sets no eval.prompts")]
    if named and not data:
        return [FieldViolation("eval_prompts", f"the spec names eval.prompts {spec.eval.prompts!r} "  # type: ignore[union-attr]
                                               "but no file contents were sent")]
    return prompt_violations(data, "eval.prompts") if named else []
