"""Built-in reward functions, by name, each with a strict parameter model.

A built-in is `fn(completion, prompt, params, **metadata) -> float | dict`; a dict's "reward"
entry (or the sum of its entries) is the reward and the other entries are reported components.
All of them run inside sandboxed workers like user files do (sympy can hang on hostile input and
`code_tests` runs model-written code), never in the service process.

Built-ins and their `params`:

- `numeric_match`: the completion's number equals the gold number.
  `answer_key` ("answer"): metadata field with the gold answer (its number is extracted with `auto`).
  `extract` ("auto"): where the completion's answer is: "last_number", "boxed" (last `\\boxed{}`),
  "hash" (after `#### `), "strict" (the whole completion is one number), "auto" (boxed, then hash,
  then last number). `rel_tol` (1e-6), `abs_tol` (1e-9): equality tolerances.
  `correct_weight` (1.0), `format_weight` (0.0): with format_weight > 0 the result is
  {"correct": 0|1, "format": 0|1, "reward": correct_weight*correct + format_weight*format}, where
  format is 1 when the completion is only a number (what "Answer with just the number." asks for);
  otherwise {"correct": 0|1} scaled by correct_weight.
- `exact_match`: the extracted answer equals the gold string after normalisation (whitespace
  collapsed, trailing period dropped, case folded unless `case_sensitive`). `answer_key`, `extract`
  ("none" | the numeric_match modes), `case_sensitive` (false).
- `math_equiv`: mathematical equivalence by HuggingFace `math-verify` (LaTeX and plain expressions,
  boxed answers, sets, intervals). `answer_key`, `float_rounding` (6), `strict` (true),
  `timeout_s` (5, math-verify's own parse and verify timeouts).
- `regex`: `pattern` matched against the completion; `mode` "search" | "match" | "fullmatch",
  `ignore_case`, `dotall`, `multiline` (false); gives `reward_match` (1.0) or `reward_no_match` (0.0).
- `length_penalty`: 0 up to `max_length` `unit`s ("chars" | "words" | "lines"), then falling
  linearly to -`penalty` (1.0) at twice max_length, and staying there.
- `code_tests`: the fraction of tests the completion's program passes, each test in its own
  sandboxed child with `per_test_timeout_s` (2.0). `extract`: "last_code_block" (last fenced block,
  else the whole text) | "whole"; `tests`: list of tests, or None to read metadata[`tests_key`]
  ("tests"); a test is a Python statement run after the program (e.g. "assert f(2) == 4") or
  {"input": stdin, "output": expected stdout}. Returns {"pass_rate", "all_passed", "reward"}.
- `weighted_sum`: `terms`: list of {"builtin", "params", "weight" (1.0), "name" (the builtin)};
  returns each term's reward under its name and "reward" = sum of weight * term reward.
  E.g. the addition task: numeric_match (weight 1, name "correct") + regex
  {"pattern": "\\\\s*-?\\\\d+\\\\s*", "mode": "fullmatch"} (weight 0.5, name "format").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleetrl.reward import codeexec

Value = float | dict[str, float]
Extract = Literal["auto", "last_number", "boxed", "hash", "strict"]


class Params(BaseModel):
    """Base of every built-in's params: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


@dataclass(frozen=True)
class Builtin:
    """A registered built-in: its function and its params model."""

    fn: Callable[..., Value]
    params: type[Params]
    needs: tuple[str, ...] = ()


REGISTRY: dict[str, Builtin] = {}


def register(name: str, params: type[Params], needs: tuple[str, ...] = ()) -> Callable[..., Any]:
    def add(fn: Callable[..., Value]) -> Callable[..., Value]:
        REGISTRY[name] = Builtin(fn, params, needs)
        return fn

    return add


# --------------------------------------------------------------------------- extraction

NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(NUMBER)
_HASH_RE = re.compile(r"####\s*(" + NUMBER + ")")
_STRICT_RE = re.compile(r"\s*(" + NUMBER + r")\s*")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[begin:i - 1] if depth == 0 else None


def extract_answer(text: str, mode: str) -> str | None:
    """The answer text of a completion by mode; None when there is none."""
    if mode == "none":
        return text
    if mode == "boxed":
        return last_boxed(text)
    if mode == "hash":
        found = _HASH_RE.findall(text)
        return found[-1] if found else None
    if mode == "strict":
        match = _STRICT_RE.fullmatch(text)
        return match.group(1) if match else None
    if mode == "last_number":
        found = _NUMBER_RE.findall(text)
        return found[-1] if found else None
    for sub in ("boxed", "hash", "last_number"):
        answer = extract_answer(text, sub)
        if answer is not None:
            return answer
    return None


def to_number(text: str | None) -> float | None:
    """The number in text (commas, $ and a trailing period allowed), or None."""
    if text is None:
        return None
    found = _NUMBER_RE.findall(text.replace("$", ""))
    if len(found) != 1:
        return None
    try:
        return float(found[0].replace(",", ""))
    except ValueError:
        return None


def gold(metadata: dict[str, Any], key: str) -> str:
    if key not in metadata:
        raise KeyError(f"metadata has no {key!r} (the gold answer)")
    return str(metadata[key])


# --------------------------------------------------------------------------- match built-ins


class NumericParams(Params):
    answer_key: str = "answer"
    """Metadata field holding the gold answer."""
    extract: Extract = "auto"
    """Where the completion's answer is (see the module docstring)."""
    rel_tol: float = Field(1e-6, ge=0)
    """Relative tolerance."""
    abs_tol: float = Field(1e-9, ge=0)
    """Absolute tolerance."""
    correct_weight: float = 1.0
    """Weight of the `correct` component."""
    format_weight: float = 0.0
    """Weight of the `format` component (completion is only a number); 0 leaves it out."""


@register("numeric_match", NumericParams)
def numeric_match(completion: str, prompt: str, params: NumericParams, **metadata: Any) -> Value:
    want = to_number(extract_answer(gold(metadata, params.answer_key), "auto"))
    got = to_number(extract_answer(completion, params.extract))
    correct = float(got is not None and want is not None
                    and math.isclose(got, want, rel_tol=params.rel_tol, abs_tol=params.abs_tol))
    if params.format_weight == 0:
        return {"correct": correct, "reward": params.correct_weight * correct}
    fmt = float(_STRICT_RE.fullmatch(completion) is not None)
    return {"correct": correct, "format": fmt,
            "reward": params.correct_weight * correct + params.format_weight * fmt}


class ExactParams(Params):
    answer_key: str = "answer"
    """Metadata field holding the gold answer."""
    extract: Literal["none", "auto", "last_number", "boxed", "hash", "strict"] = "none"
    """Where the completion's answer is; "none" compares the whole completion."""
    case_sensitive: bool = False
    """Compare case-sensitively."""


def normalise(text: str, case_sensitive: bool) -> str:
    text = " ".join(text.split()).rstrip(".").strip()
    return text if case_sensitive else text.casefold()


@register("exact_match", ExactParams)
def exact_match(completion: str, prompt: str, params: ExactParams, **metadata: Any) -> Value:
    got = extract_answer(completion, params.extract)
    want = gold(metadata, params.answer_key)
    return float(got is not None and normalise(got, params.case_sensitive) == normalise(want, params.case_sensitive))


class MathParams(Params):
    answer_key: str = "answer"
    """Metadata field holding the gold answer (LaTeX or plain)."""
    float_rounding: int = Field(6, ge=0, le=20)
    """Decimal places numbers are rounded to before comparing."""
    strict: bool = True
    """math-verify strict mode (variables must match, no set/interval leniency)."""
    timeout_s: int = Field(5, ge=1, le=60)
    """math-verify's own parse and verify timeouts."""


@register("math_equiv", MathParams, needs=("math_verify",))
def math_equiv(completion: str, prompt: str, params: MathParams, **metadata: Any) -> Value:
    from math_verify import parse, verify

    answer = gold(metadata, params.answer_key)
    if "$" not in answer and "\\boxed" not in answer:
        answer = f"${answer}$"
    gold_parsed = parse(answer, parsing_timeout=params.timeout_s)
    pred = parse(completion, parsing_timeout=params.timeout_s)
    same = verify(gold_parsed, pred, float_rounding=params.float_rounding, strict=params.strict,
                  timeout_seconds=params.timeout_s)
    return float(bool(gold_parsed) and bool(pred) and same)


# --------------------------------------------------------------------------- shape built-ins


class RegexParams(Params):
    pattern: str
    """Regular expression (Python `re` syntax)."""
    mode: Literal["search", "match", "fullmatch"] = "search"
    """How the pattern must match the completion."""
    ignore_case: bool = False
    """re.IGNORECASE."""
    dotall: bool = False
    """re.DOTALL."""
    multiline: bool = False
    """re.MULTILINE."""
    reward_match: float = 1.0
    """Reward when it matches."""
    reward_no_match: float = 0.0
    """Reward when it does not."""

    def compiled(self) -> re.Pattern[str]:
        flags = (re.IGNORECASE * self.ignore_case) | (re.DOTALL * self.dotall) | (re.MULTILINE * self.multiline)
        return re.compile(self.pattern, flags)

    @model_validator(mode="after")
    def _compiles(self) -> RegexParams:
        try:
            self.compiled()
        except re.error as error:
            raise ValueError(f"pattern does not compile: {error}") from None
        return self


@register("regex", RegexParams)
def regex(completion: str, prompt: str, params: RegexParams, **metadata: Any) -> Value:
    matched = getattr(params.compiled(), params.mode)(completion) is not None
    return params.reward_match if matched else params.reward_no_match


class LengthParams(Params):
    max_length: int = Field(ge=1)
    """Length allowed without penalty."""
    unit: Literal["chars", "words", "lines"] = "chars"
    """What is counted."""
    penalty: float = Field(1.0, ge=0)
    """Penalty at (and beyond) twice max_length."""


@register("length_penalty", LengthParams)
def length_penalty(completion: str, prompt: str, params: LengthParams, **metadata: Any) -> Value:
    size = {"chars": len(completion), "words": len(completion.split()),
            "lines": len(completion.splitlines())}[params.unit]
    excess = max(0, size - params.max_length) / params.max_length
    return -params.penalty * min(1.0, excess)


# --------------------------------------------------------------------------- code and combination

_FENCE_RE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.DOTALL)


class CodeParams(Params):
    extract: Literal["last_code_block", "whole"] = "last_code_block"
    """Which part of the completion is the program."""
    tests: list[str | dict[str, str]] | None = None
    """Tests (statements or {"input", "output"}); None reads them from metadata[tests_key]."""
    tests_key: str = "tests"
    """Metadata field holding the tests when `tests` is None."""
    per_test_timeout_s: float = Field(2.0, gt=0, le=60)
    """Wall-clock limit of one test run."""
    max_output_bytes: int = Field(65536, ge=1, le=16 * 1024 * 1024)
    """Program output read for comparison."""


@register("code_tests", CodeParams)
def code_tests(completion: str, prompt: str, params: CodeParams, **metadata: Any) -> Value:
    blocks = _FENCE_RE.findall(completion) if params.extract == "last_code_block" else []
    program = blocks[-1] if blocks else completion
    tests = params.tests if params.tests is not None else metadata.get(params.tests_key)
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"no tests: set params.tests or metadata[{params.tests_key!r}] to a non-empty list")
    passed = sum(codeexec.run_test(program, t, params.per_test_timeout_s, params.max_output_bytes) for t in tests)
    rate = passed / len(tests)
    return {"pass_rate": rate, "all_passed": float(passed == len(tests)), "reward": rate}


class Term(Params):
    builtin: str
    """Name of the built-in."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Its params."""
    weight: float = 1.0
    """Weight of its reward in the sum."""
    name: str | None = None
    """Component name; defaults to the builtin's name."""

    @model_validator(mode="after")
    def _known(self) -> Term:
        try:
            resolve(self.builtin, self.params)
        except KeyError as error:
            raise ValueError(str(error.args[0])) from None
        return self


class SumParams(Params):
    terms: list[Term] = Field(min_length=1)
    """The weighted terms."""

    @model_validator(mode="after")
    def _unique(self) -> SumParams:
        names = [t.name or t.builtin for t in self.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"term names must be unique, got {names}")
        return self


def scalar(value: Value) -> float:
    """The reward of a built-in's value: itself, its "reward" entry, or the sum of its entries."""
    if isinstance(value, dict):
        return value["reward"] if "reward" in value else sum(value.values())
    return float(value)


@register("weighted_sum", SumParams)
def weighted_sum(completion: str, prompt: str, params: SumParams, **metadata: Any) -> Value:
    out: dict[str, float] = {}
    total = 0.0
    for term in params.terms:
        value = scalar(resolve(term.builtin, term.params)(completion, prompt, **metadata))
        out[term.name or term.builtin] = value
        total += term.weight * value
    out["reward"] = total
    return out


# --------------------------------------------------------------------------- lookup


def resolve(name: str, params: dict[str, Any]) -> Callable[..., Value]:
    """fn(completion, prompt, **metadata) for a built-in; KeyError or ValidationError when bad."""
    if name not in REGISTRY:
        raise KeyError(f"unknown built-in {name!r}; known: {sorted(REGISTRY)}")
    entry = REGISTRY[name]
    parsed = entry.params.model_validate(params)
    return lambda completion, prompt, **metadata: entry.fn(completion, prompt, parsed, **metadata)


RUNS_SUBMITTED_CODE = frozenset({"code_tests"})
"""Built-ins that execute text from outside the service (a completion as a program)."""


def runs_submitted_code(name: str, params: dict[str, Any]) -> bool:
    """Whether a built-in (or one of weighted_sum's terms, at any depth) executes submitted text as code."""
    if name in RUNS_SUBMITTED_CODE:
        return True
    if name == "weighted_sum":
        terms = params.get("terms", [])
        return any(runs_submitted_code(t.get("builtin", ""), t.get("params", {})) for t in terms
                   if isinstance(t, dict))
    return False


def needed_modules(name: str, params: dict[str, Any]) -> set[str]:
    """Modules a built-in (and its terms) imports lazily, to load before the uid drop."""
    entry = REGISTRY[name]
    needs = set(entry.needs)
    if name == "weighted_sum":
        for term in SumParams.model_validate(params).terms:
            needs |= needed_modules(term.builtin, term.params)
    return needs


def preload(name: str, params: dict[str, Any]) -> None:
    """Import what the built-in needs while the worker may still read everything."""
    import importlib

    resolve(name, params)
    for module in needed_modules(name, params):
        importlib.import_module(module)
