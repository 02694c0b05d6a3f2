"""The demonstrations file of an sft job: its one reader, and the check a submitted file passes.

An sft job's `prompts` file holds one conversation per line, in chat format:

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...],
     "tools": [{"type": "function", "function": {...}}]}

`messages` is a non-empty list of objects, each with a `role` (system, user, assistant or tool) and a string
`content` (other keys, such as a tool message's `name`, go to the chat template as they are); at least one
message is the assistant's, since only assistant tokens are trained, and the first is not (nothing would
come before it to predict it from). `tools`, optional, is a list of JSON objects (function schemas) given to
the chat template, which renders them where it has a tool format. Other keys of a line are ignored.

The learner reads the file with `read_demonstrations` (blank lines skipped, the first bad line named); a
submission is checked whole by `demonstration_violations` (every bad line, one problem each, blank lines
included), so a file the gateway accepted reads the same in the learner. What needs the model's tokenizer
(a conversation's length, a template that cannot mark its assistant tokens) is checked by
`fleetrl.policy.chat_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetrl.errors import ConfigError, FieldViolation, clip
from fleetrl.spec.prompts import capped, line_object, utf8_text

ROLES = ("system", "user", "assistant", "tool")
"""The message roles a demonstration may hold."""


@dataclass(frozen=True)
class Demonstration:
    """One conversation of a demonstrations file."""

    line: int
    """Its 1-based line number in the file (what errors name)."""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def read_demonstrations(data: bytes, field: str = "prompts") -> list[Demonstration]:
    """The conversations of a demonstrations file's non-empty lines, in order; ConfigError naming
    `<field>[line N]...` and why for the first bad line, or `field` when the file is not UTF-8 or holds none."""
    out: list[Demonstration] = []
    for number, line in enumerate(utf8_text(data, field).splitlines(), start=1):
        if not line.strip():
            continue
        demonstration, problem = parse_line(line, number)
        if demonstration is None:
            where, why = problem or ("", "unreadable")
            raise ConfigError(f"bad {field} file", [FieldViolation(f"{field}[line {number}]{where}", why)])
        out.append(demonstration)
    if not out:
        raise ConfigError(f"bad {field} file", [FieldViolation(field, "the file holds no conversation")])
    return out


def demonstration_violations(data: bytes, field: str = "prompts") -> list[FieldViolation]:
    """Every bad line of a submitted demonstrations file (`prompts[line N]...`, 1-based), the first problem of
    each, at most MAX_REPORTED_LINES lines."""
    if not data.strip():
        return [FieldViolation(field, "the demonstrations file is empty")]
    try:
        text = utf8_text(data, field)
    except ConfigError as error:
        return error.violations
    bad = []
    for number, line in enumerate(text.splitlines(), start=1):
        _, problem = parse_line(line, number)
        if problem is not None:
            bad.append(FieldViolation(f"{field}[line {number}]{problem[0]}", problem[1]))
    return capped(bad, field)


def parse_line(line: str, number: int) -> tuple[Demonstration | None, tuple[str, str] | None]:
    """The line's conversation, or None and (the path within the line, why) of its first problem."""
    item, problem = line_object(line)
    if item is None:
        return None, ("", problem or "not a JSON object")
    messages, tools = item.get("messages"), item.get("tools")
    if not isinstance(messages, list) or not messages:
        return None, (".messages", "needs a non-empty list of messages")
    for index, message in enumerate(messages):
        if (why := message_problem(message)) is not None:
            return None, (f".messages[{index}]{why[0]}", why[1])
    if not any(message["role"] == "assistant" for message in messages):
        return None, (".messages", "no assistant message: an sft job trains on assistant tokens only")
    if messages[0]["role"] == "assistant":
        return None, (".messages[0]", "the conversation opens with the assistant: there is nothing to predict its "
                                      "first message from")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        return None, (".tools", "must be a list of JSON objects (function schemas)")
    return Demonstration(number, messages, tools or None), None


def message_problem(message: Any) -> tuple[str, str] | None:
    """(the path within the message, why) when a message is unusable, or None."""
    if not isinstance(message, dict):
        return "", "not a JSON object"
    if message.get("role") not in ROLES:
        return ".role", f"must be one of {', '.join(ROLES)}, not {clip(repr(message.get('role')), 40)}"
    if not isinstance(message.get("content"), str):
        return ".content", "must be a string"
    return None
