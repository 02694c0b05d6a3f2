"""The prompt JSONL file: its one reader, and the check a submitted file passes.

A prompt file holds one JSON object per line with a non-empty string "prompt"; the line's other fields
are the task's metadata (a verifier's answer, `code_tests`' tests, an environment's task data). The
feeder, the learner's held-out set, `fleetrl eval`, the demo and the reference loop read prompt files
with `read_prompts`, which skips blank lines and names the first bad line. A submission is checked
whole by `prompt_violations` (every bad line, blank lines included), so a file the gateway accepted
reads the same everywhere.
"""

from __future__ import annotations

import json
from typing import Any

from fleetrl.errors import ConfigError, FieldViolation
from fleetrl.spec.config import value_problems

MAX_REPORTED_LINES = 20
"""Most bad lines one submission check reports (the rest are counted)."""


def read_prompts(data: bytes, field: str = "prompts") -> list[dict[str, Any]]:
    """The objects of a prompt file's non-empty lines, in order; ConfigError naming `<field>[line N]` and
    why for the first bad line, or `field` when the file is not UTF-8 or holds no prompt."""
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(utf8_text(data, field).splitlines(), start=1):
        if not line.strip():
            continue
        if problem := line_problem(line):
            raise ConfigError(f"bad {field} file", [FieldViolation(f"{field}[line {number}]", problem)])
        rows.append(json.loads(line))
    if not rows:
        raise ConfigError(f"bad {field} file", [FieldViolation(field, "the file holds no prompt")])
    return rows


def prompt_violations(data: bytes, field: str = "prompts") -> list[FieldViolation]:
    """Every bad line of a submitted prompt file (`prompts[line N]`, 1-based), at most MAX_REPORTED_LINES."""
    if not data.strip():
        return [FieldViolation(field, "the prompt file is empty")]
    try:
        text = utf8_text(data, field)
    except ConfigError as error:
        return error.violations
    return capped([FieldViolation(f"{field}[line {n}]", problem)
                   for n, line in enumerate(text.splitlines(), 1) if (problem := line_problem(line))], field)


def capped(bad: list[FieldViolation], field: str) -> list[FieldViolation]:
    """The first MAX_REPORTED_LINES bad lines of a file, and a count of the rest under `field`."""
    if len(bad) <= MAX_REPORTED_LINES:
        return bad
    more = len(bad) - MAX_REPORTED_LINES
    return [*bad[:MAX_REPORTED_LINES], FieldViolation(field, f"{more} more bad lines not shown")]


def line_problem(line: str) -> str | None:
    """Why one prompt line is unusable, or None."""
    item, problem = line_object(line)
    if item is None:
        return problem
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        return 'needs a non-empty string field "prompt"'
    return None


def line_object(line: str) -> tuple[dict[str, Any] | None, str | None]:
    """A JSONL line's object, or None and why the line holds none (blank, not JSON, not an object, or a
    string with an unpaired surrogate escape)."""
    if not line.strip():
        return None, "blank line: the file must hold one JSON object per line"
    try:
        item = json.loads(line)
    except ValueError as error:  # JSONDecodeError, or an integer literal of more than 4300 digits
        return None, f"not JSON: {error}"
    except RecursionError:
        return None, "not JSON: nested too deeply"
    if not isinstance(item, dict):
        return None, "not a JSON object"
    if "\\u" in line and (problems := value_problems(item, max_depth=None)):  # an unpaired surrogate escape
        return None, "; ".join(f"{v.field}: {v.description}" for v in problems[:3])
    return item, None


def utf8_text(data: bytes, field: str) -> str:
    """A submitted file's text; ConfigError naming `field` when it is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"bad {field} file", [FieldViolation(field, f"not UTF-8: {error}")]) from None
